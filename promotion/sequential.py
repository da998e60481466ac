"""An always-valid comparison of two streams of outcomes, safe to check continuously.

A fixed-sample test looked at every few seconds finds a "significant" difference far
more often than its level says. The mixture sequential probability ratio test (mSPRT)
of Johari, Koomen, Pekelis & Walsh ("Always valid inference: continuous monitoring of
A/B tests", Operations Research 2022) does not: with a normal mixture N(0, tau^2) over
the difference theta = mean_B - mean_A, and V the variance of the observed difference,

    Lambda(theta0) = sqrt(V / (V + tau^2)) * exp(tau^2 (d - theta0)^2 / (2 V (V + tau^2)))

is a (CLT-approximate) martingale under theta = theta0, so by Ville's inequality it ever
exceeds 1/alpha with probability at most alpha. Inverting it gives a confidence sequence,
an interval that holds at every look at once:

    d +- sqrt( 2 V (V + tau^2) / tau^2 * log( sqrt((V + tau^2) / V) / alpha ) )

V uses each arm's variance shrunk toward `prior_var` by two pseudo-observations, so an
arm whose first outcomes are all equal does not look certain.

Promotion asks a one-sided question (is the canary above -margin?), so its bound comes
from the one-sided mixture, over theta > theta0 only (Howard, Ramdas, McAuliffe & Sekhon,
"Time-uniform, nonparametric, nonasymptotic confidence sequences", Ann. Statist. 2021):

    Lambda+(theta0) = 2 sqrt(V / (V + tau^2)) * exp(tau^2 u^2 / (2 V (V + tau^2)))
                      * Phi(u tau / sqrt(V (V + tau^2))),        u = d - theta0

and the lower bound d - u* where Lambda+ reaches 1/alpha, about the two-sided half-width at
2 alpha. The upper bound an abort needs stays the two-sided one: its one-sided form let
more simulated null runs than alpha be called worse (docs/learning.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, Field


class Arm(BaseModel):
    """The outcomes of one version so far: count, sum and sum of squares."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, n: int, total: float, squares: float) -> None:
        self.n, self.total, self.squares = self.n + n, self.total + total, self.squares + squares

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    def variance(self, prior_var: float) -> float:
        deviations = max(self.squares - self.n * self.mean**2, 0.0)
        return (deviations + 2 * prior_var) / (self.n + 1)


def confidence_sequence(a: Arm, b: Arm, alpha: float, tau: float,
                        prior_var: float = 0.25) -> tuple[float, float, float]:
    """(d, low, high): the difference of means b - a and its always-valid 1 - alpha interval."""
    d = b.mean - a.mean
    if a.n == 0 or b.n == 0:
        return d, -math.inf, math.inf
    half = half_width(difference_variance(a, b, prior_var), alpha, tau)
    return d, d - half, d + half


def difference_variance(a: Arm, b: Arm, prior_var: float) -> float:
    """V, the variance of the observed difference of means."""
    return a.variance(prior_var) / a.n + b.variance(prior_var) / b.n


def half_width(v: float, alpha: float, tau: float) -> float:
    """The confidence sequence's half-width at difference variance `v` (above)."""
    t2 = tau * tau
    return math.sqrt(2 * v * (v + t2) / t2 * math.log(math.sqrt((v + t2) / v) / alpha))


def lower_distance(v: float, alpha: float, tau: float) -> float:
    """u*, the distance from d down to the one-sided mixture's lower bound (above): the
    root of log Lambda+(u) = log(1 / alpha). In z = u tau / sqrt(V (V + tau^2)) it reads
    z^2 / 2 + log Phi(z) = log(1 / alpha) - log 2 - log sqrt(V / (V + tau^2)), whose left side
    grows and is convex, so Newton's method started right of the root walks down to it in a
    few steps (bisection took fifty; the guard asks for it at every look)."""
    s = v + tau * tau
    target = math.log(1 / alpha) - math.log(2) - 0.5 * math.log(v / s)
    z = math.sqrt(2 * (target + math.log(2)))  # log Phi(z) >= log(1/2) for z >= 0: right of the root
    for _ in range(100):
        log_phi = math.log(0.5 * math.erfc(-z / math.sqrt(2)))
        slope = z + math.exp(-z * z / 2 - log_phi) / math.sqrt(2 * math.pi)  # z + phi(z) / Phi(z)
        step = (z * z / 2 + log_phi - target) / slope
        z -= step
        if step <= 1e-12 * z:
            break
    return z * math.sqrt(v * s) / tau


def samples_to_clear(room: float, v: float, n: int, *, alpha: float, tau: float,
                     width: Callable[[float, float, float], float] = half_width) -> int | None:
    """About how many canary outcomes the interval needs before its `width` (from d to a
    bound) is below `room`, both arms growing in proportion (V shrinks as 1/n from `v` at
    `n`); None if `room` is not positive. With the difference held where it is, room
    d + margin with `lower_distance` gives the outcomes to a non-inferior verdict, room -d
    with `half_width` those to a worse one. A projection for giving way to a newer
    candidate (futility, as in group-sequential trials), never a verdict: it decides
    nothing about the canary."""
    if room <= 0 or n == 0:
        return None
    low, high = n, n
    while width(v * n / high, alpha, tau) >= room:
        low, high = high, high * 2
    while high - low > 1:  # the width shrinks as n grows: bisect for the first n that clears
        middle = (low + high) // 2
        low, high = (middle, high) if width(v * n / middle, alpha, tau) >= room else (low, middle)
    return high if width(v * n / low, alpha, tau) >= room else low


Decision = Literal["continue", "worse", "non_inferior", "inconclusive"]


class Comparison(BaseModel):
    """One look at a canary against stable on one metric."""

    metric: str
    decision: Decision
    canary_n: int
    stable_n: int
    canary_mean: float
    stable_mean: float
    difference: float = Field(description="canary - stable")
    low: float = Field(description="Always-valid one-sided lower bound of the difference (what promotion "
                       "clears).")
    high: float = Field(description="Always-valid upper bound of the difference (the two-sided sequence's: "
                        "what an abort falls below).")
    to_non_inferior: int | None = Field(None, description="Canary outcomes at which, the difference held where "
                                        "it is, the interval would clear -margin (None: never).")
    to_worse: int | None = Field(None, description="Canary outcomes at which, the difference held where it is, "
                                 "the interval would fall below 0 (None: never).")


def compare(metric: str, stable: Arm, canary: Arm, *, alpha: float, tau: float, margin: float,
            min_samples: int, promotion_alpha: float | None = None, prior_var: float = 0.25) -> Comparison:
    """Clearly worse when the two-sided 1 - alpha interval is below 0; non-inferior when the
    one-sided 1 - promotion_alpha lower bound (default alpha) is above -margin; otherwise
    keep looking. `min_samples` per arm before any verdict: the normal approximation needs
    a few dozen outcomes."""
    promotion_alpha = alpha if promotion_alpha is None else promotion_alpha
    d, _, high = confidence_sequence(stable, canary, alpha, tau, prior_var)
    low, projected = -math.inf, {}
    if stable.n and canary.n:
        v = difference_variance(stable, canary, prior_var)
        low = d - lower_distance(v, promotion_alpha, tau)
        projected = {"to_non_inferior": samples_to_clear(d + margin, v, canary.n, alpha=promotion_alpha, tau=tau,
                                                         width=lower_distance),
                     "to_worse": samples_to_clear(-d, v, canary.n, alpha=alpha, tau=tau)}
    decision: Decision = "continue"
    if min(stable.n, canary.n) >= min_samples:
        if high < 0:
            decision = "worse"
        elif low > -margin:
            decision = "non_inferior"
    return Comparison(metric=metric, decision=decision, canary_n=canary.n, stable_n=stable.n,
                      canary_mean=canary.mean, stable_mean=stable.mean, difference=d,
                      low=max(low, -1e9), high=min(high, 1e9), **projected)


def verdict_in_sight(looks: list[Comparison], within: int) -> bool:
    """Whether, the differences held where they are, the canary would get a verdict within
    `within` outcomes: worse on some metric, or non-inferior on all."""
    worse = any(c.to_worse is not None and c.to_worse <= within for c in looks)
    return worse or all(c.to_non_inferior is not None and c.to_non_inferior <= within for c in looks)


def wilson(accepted: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion: for one look (a plot, a report), not for
    a decision taken while looking repeatedly (that is `compare`)."""
    if n == 0:
        return 0.0, 1.0
    p = accepted / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def paired_loss_p(lost: int, gained: int) -> float:
    """One-sided exact sign test (McNemar's, exact) for two versions scored on the same
    tasks: of the tasks exactly one of them solves, `lost` only the first solves and
    `gained` only the second. Under "neither is better" each such task goes either way
    with probability 1/2, so this is P(X >= lost), X ~ Binomial(lost + gained, 1/2): the
    chance of losing at least this many by luck alone. Tasks both (or neither) solve say
    nothing about the difference and do not count."""
    n = lost + gained
    return sum(math.comb(n, k) for k in range(lost, n + 1)) / 2 ** n


class SkillComparison(BaseModel):
    """A version's held-out figures against a reference's on the same tasks, task by task:
    the skill guard's verdict before a canary and the held-out watch's on a stable."""

    evaluation: str = Field(description="The held-out evaluation (the environment's name).")
    reference: str = Field(description="The version compared with.")
    tasks: int
    pass_rate: float = Field(description="The version's held-out pass rate.")
    reference_pass_rate: float
    lost: int = Field(description="Tasks only the reference solves.")
    gained: int = Field(description="Tasks only the version solves.")
    p: float = Field(description="One-sided exact sign test: the chance of losing at least `lost` by luck.")
    level: float = Field(description="What p must be under to call it a loss (the error rate, split when the "
                         "best of several references is compared).")
    margin: float
    lost_skill: bool = Field(description="Surely below the reference, and by more than the margin.")

    def text(self) -> str:
        return (f"{self.evaluation}: held-out pass rate {self.pass_rate:.3f} against {self.reference}'s "
                f"{self.reference_pass_rate:.3f} on the same {self.tasks} tasks ({self.lost} lost, {self.gained} "
                f"gained; p {self.p:.2g} {'<' if self.p < self.level else '>='} {self.level:.2g})")


def compare_skill(evaluation: str, reference: str, reference_solved: str, solved: str, *, margin: float,
                  level: float) -> SkillComparison:
    """`solved` against `reference_solved` (strings of 0s and 1s on the same tasks): lost
    when the exact sign test on the tasks exactly one solves says the version is below by
    more than luck (`paired_loss_p` < `level`) and its pass rate is more than `margin` under
    the reference's. Tasks both or neither solve carry no evidence and do not count."""
    if len(solved) != len(reference_solved):
        raise ValueError(f"{evaluation}: {len(solved)} tasks against {reference}'s {len(reference_solved)}: "
                         "figures on different task sets do not compare")
    pairs = list(zip(reference_solved, solved, strict=True))
    lost, gained = pairs.count(("1", "0")), pairs.count(("0", "1"))
    rate, reference_rate = solved.count("1") / len(solved), reference_solved.count("1") / len(solved)
    p = paired_loss_p(lost, gained)
    return SkillComparison(evaluation=evaluation, reference=reference, tasks=len(solved), pass_rate=rate,
                           reference_pass_rate=reference_rate, lost=lost, gained=gained, p=p, level=level,
                           margin=margin, lost_skill=reference_rate - rate > margin and p < level)
