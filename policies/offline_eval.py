"""The offline gate: is a candidate at least as good as its parent on held-out logs?

Both policies are scored on the same held-out logged samples by self-normalised
importance sampling (SNIS). A sequence's weight is the geometric mean of its
per-token ratios pi/mu, clipped to [1/c, c]: length-normalised so a long completion's
weight does not explode or vanish (the sequence-level ratio of GSPO, Zheng et al.
2025); it trades a little bias for a usable effective sample size. The gate judges the
difference of the two estimates, whose interval is paired on those samples.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, Field


class Estimate(BaseModel):
    value: float
    stderr: float
    ess: float
    n: int

    @property
    def lower(self) -> float:
        """95% lower confidence bound (normal approximation)."""
        return self.value - 1.96 * self.stderr


class Verdict(BaseModel):
    passed: bool
    reason: str
    too_far_from_stable: bool = Field(False, description="Failed on the KL ceiling: every version trained "
                                      "on top would be further still (the learner rewinds).")
    candidate: Estimate
    parent: Estimate
    difference: Estimate = Field(description="Candidate minus parent on the same samples (snis_difference).")
    kl_from_stable: float | None = Field(None, description="Mean per-token KL(stable || candidate) on held-out "
                                         "logged samples (policies/divergence.py).")


def _snis_terms(mean_log_ratio: torch.Tensor, rewards: torch.Tensor, clip: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SNIS's estimate, each sample's influence on it and the clipped weights. The estimate's
    error is about the mean of the influences, w_i / mean(w) * (r_i - value) (the delta
    method), so its variance is sum(influence^2) / n^2."""
    weights = torch.exp(mean_log_ratio.clamp(-math.log(clip), math.log(clip)))
    value = (weights * rewards).sum() / weights.sum()
    return value, weights / weights.mean() * (rewards - value), weights


def _estimate(value: torch.Tensor, influence: torch.Tensor, ess: float) -> Estimate:
    n = len(influence)
    return Estimate(value=value.item(), stderr=(influence.square().sum().sqrt() / n).item(), ess=ess, n=n)


def snis(mean_log_ratio: torch.Tensor, rewards: torch.Tensor, clip: float = 2.0) -> Estimate:
    """Self-normalised IS estimate of the mean reward, with its stderr and ESS."""
    value, influence, weights = _snis_terms(mean_log_ratio, rewards, clip)
    return _estimate(value, influence, (weights.sum() ** 2 / weights.square().sum()).item())


def snis_difference(candidate_log_ratio: torch.Tensor, parent_log_ratio: torch.Tensor, rewards: torch.Tensor,
                    clip: float = 2.0) -> Estimate:
    """The candidate's SNIS estimate minus the parent's on the same held-out samples. Its
    stderr comes from the difference of the two influences sample by sample: the noise the
    two estimates share (which samples happened to be held out) cancels, so a candidate
    close to its parent is judged on far fewer samples than its own interval would need
    (a paired comparison). Its ESS is the smaller of the two."""
    candidate, candidate_influence, candidate_weights = _snis_terms(candidate_log_ratio, rewards, clip)
    parent, parent_influence, parent_weights = _snis_terms(parent_log_ratio, rewards, clip)
    ess = min((w.sum() ** 2 / w.square().sum()).item() for w in (candidate_weights, parent_weights))
    return _estimate(candidate - parent, candidate_influence - parent_influence, ess)


class Interval(BaseModel):
    """An off-policy estimate of a policy's mean reward with a 95% interval that stays
    valid when weights are capped: the cap's bias is inside [low, high]."""

    value: float
    low: float
    high: float
    missing_mass: float = Field(description="1 - mean capped weight: how much the cap left out.")
    n: int


def capped_is(log_ratio: torch.Tensor, rewards: torch.Tensor, cap: float = 10.0,
              reward_range: tuple[float, float] = (0.0, 1.0), z: float = 1.96) -> Interval:
    """Capped importance sampling with its bias bounded (Bottou et al. 2013,
    "Counterfactual reasoning and learning systems", JMLR 14, section 4.4).

    With w = pi/mu the exact ratio of each logged action and w' = min(w, cap):

        E_pi[r] = E_mu[w' r] + E_mu[(w - w') r]          the second term is the cap's bias,
        0 <= E_mu[(w - w') r] - r_min (1 - E_mu[w']) <= (r_max - r_min) (1 - E_mu[w'])

    since E_mu[w] = 1 and r_min <= r <= r_max. So E_mu[w' (r - r_min)] + r_min is a lower
    bound and adding (r_max - r_min) (1 - E_mu[w']) an upper one; each side gets its
    normal sampling error. The interval widens exactly as much as the cap bites, which the
    offline gate's clipped, self-normalised estimate does not (its interval misses the
    true value once ratios pass the clip)."""
    r_min, r_max = reward_range
    weights = torch.exp(log_ratio).clamp(max=cap)
    shifted = weights * (rewards - r_min)
    n = len(rewards)
    mean, se = shifted.mean(), shifted.std() / math.sqrt(n)
    missing = (1 - weights.mean()).clamp(min=0)
    missing_se = weights.std() / math.sqrt(n)
    low = r_min + mean - z * se
    high = r_min + mean + (r_max - r_min) * missing + z * (se + (r_max - r_min) * missing_se)
    return Interval(value=(r_min + mean).item(), low=low.item(), high=high.item(), missing_mass=missing.item(), n=n)


def offline_check(candidate: Estimate, parent: Estimate, difference: Estimate, margin: float, min_ess: float,
                  kl_from_stable: float | None = None, max_kl: float | None = None) -> Verdict:
    """Non-inferiority on the logs: the 95% lower bound of candidate minus parent, on the
    same held-out samples, must be above -margin."""
    def verdict(passed: bool, reason: str, too_far: bool = False) -> Verdict:
        return Verdict(passed=passed, reason=reason, candidate=candidate, parent=parent, difference=difference,
                       kl_from_stable=kl_from_stable, too_far_from_stable=too_far)

    if difference.ess < min_ess:
        return verdict(False, f"inconclusive: effective sample size {difference.ess:.1f} < {min_ess}")
    if difference.lower < -margin:
        return verdict(False, f"inconclusive: the difference from the parent ({candidate.value:.3f} - "
                              f"{parent.value:.3f}) has lower bound {difference.lower:+.3f} < -margin {margin}")
    if max_kl is not None and kl_from_stable is not None and kl_from_stable > max_kl:
        # However good it looks on few samples, users would get a policy far from today's.
        return verdict(False, f"moved too far from stable: KL {kl_from_stable:.4f} > ceiling {max_kl}", too_far=True)
    return verdict(True, f"the difference from the parent ({candidate.value:.3f} - {parent.value:.3f}) has "
                         f"lower bound {difference.lower:+.3f} >= -margin {margin}")
