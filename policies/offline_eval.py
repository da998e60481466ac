"""The offline gate: is a candidate at least as good as its parent on held-out logs?

Both policies are scored on the same held-out logged samples by self-normalised
importance sampling (SNIS). A sequence's weight is the geometric mean of its
per-token ratios pi/mu, clipped to [1/c, c]: length-normalised so a long completion's
weight does not explode or vanish (the sequence-level ratio of GSPO, Zheng et al.
2025); it trades a little bias for a usable effective sample size.
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
    kl_from_stable: float | None = Field(None, description="Mean per-token KL(stable || candidate) on held-out "
                                         "logged samples (policies/divergence.py).")


def snis(mean_log_ratio: torch.Tensor, rewards: torch.Tensor, clip: float = 2.0) -> Estimate:
    """Self-normalised IS estimate of the mean reward, with its stderr and ESS."""
    weights = torch.exp(mean_log_ratio.clamp(-math.log(clip), math.log(clip)))
    total = weights.sum()
    value = (weights * rewards).sum() / total
    variance = (weights**2 * (rewards - value) ** 2).sum() / total**2
    ess = total**2 / (weights**2).sum()
    return Estimate(value=value.item(), stderr=variance.sqrt().item(), ess=ess.item(), n=len(rewards))


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


def offline_check(candidate: Estimate, parent: Estimate, margin: float, min_ess: float,
                  kl_from_stable: float | None = None, max_kl: float | None = None) -> Verdict:
    def verdict(passed: bool, reason: str, too_far: bool = False) -> Verdict:
        return Verdict(passed=passed, reason=reason, candidate=candidate, parent=parent,
                       kl_from_stable=kl_from_stable, too_far_from_stable=too_far)

    if min(candidate.ess, parent.ess) < min_ess:
        return verdict(False, f"inconclusive: effective sample size {min(candidate.ess, parent.ess):.1f} < {min_ess}")
    if candidate.lower < parent.value - margin:
        return verdict(False, f"inconclusive: lower bound {candidate.lower:.3f} < parent {parent.value:.3f} "
                              f"- margin {margin}")
    if max_kl is not None and kl_from_stable is not None and kl_from_stable > max_kl:
        # However good it looks on few samples, users would get a policy far from today's.
        return verdict(False, f"moved too far from stable: KL {kl_from_stable:.4f} > ceiling {max_kl}", too_far=True)
    return verdict(True, f"lower bound {candidate.lower:.3f} >= parent {parent.value:.3f} - {margin}")
