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
from pydantic import BaseModel


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
    candidate: Estimate
    parent: Estimate


def snis(mean_log_ratio: torch.Tensor, rewards: torch.Tensor, clip: float = 2.0) -> Estimate:
    """Self-normalised IS estimate of the mean reward, with its stderr and ESS."""
    weights = torch.exp(mean_log_ratio.clamp(-math.log(clip), math.log(clip)))
    total = weights.sum()
    value = (weights * rewards).sum() / total
    variance = (weights**2 * (rewards - value) ** 2).sum() / total**2
    ess = total**2 / (weights**2).sum()
    return Estimate(value=value.item(), stderr=variance.sqrt().item(), ess=ess.item(), n=len(rewards))


def offline_check(candidate: Estimate, parent: Estimate, margin: float, min_ess: float) -> Verdict:
    if min(candidate.ess, parent.ess) < min_ess:
        return Verdict(passed=False, reason=f"inconclusive: effective sample size "
                       f"{min(candidate.ess, parent.ess):.1f} < {min_ess}", candidate=candidate, parent=parent)
    if candidate.lower < parent.value - margin:
        return Verdict(passed=False, reason=f"inconclusive: lower bound {candidate.lower:.3f} < parent "
                       f"{parent.value:.3f} - margin {margin}", candidate=candidate, parent=parent)
    return Verdict(passed=True, reason=f"lower bound {candidate.lower:.3f} >= parent {parent.value:.3f} "
                   f"- {margin}", candidate=candidate, parent=parent)
