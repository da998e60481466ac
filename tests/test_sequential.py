"""The canary guard's sequential test on simulated outcomes (no stack needed)."""

from __future__ import annotations

import numpy as np
import pytest

from promotion.sequential import Arm, compare, confidence_sequence, half_width, lower_distance

ALPHA, TAU, MIN_SAMPLES = 0.05, 0.1, 50


def arm(outcomes) -> Arm:
    x = np.asarray(outcomes, dtype=float)
    return Arm(n=len(x), total=float(x.sum()), squares=float((x * x).sum()))


def looks(rng: np.random.Generator, p_stable: float, p_canary: float, canary_share: float,
          seeds: int, per_look: int, looks_: int) -> list[str]:
    """Each seed's first verdict when the guard looks after every `per_look` outcomes."""
    verdicts = []
    for _ in range(seeds):
        to_canary = rng.random(per_look * looks_) < canary_share
        outcome = np.where(to_canary, rng.random(to_canary.size) < p_canary,
                           rng.random(to_canary.size) < p_stable).astype(float)
        verdict = "continue"
        for end in range(per_look, to_canary.size + 1, per_look):
            c, s = outcome[:end][to_canary[:end]], outcome[:end][~to_canary[:end]]
            verdict = compare("accept_rate", arm(s), arm(c), alpha=ALPHA, tau=TAU, margin=0.05,
                              min_samples=MIN_SAMPLES).decision
            if verdict != "continue":
                break
        verdicts.append(verdict)
    return verdicts


@pytest.mark.parametrize("p, share", [(0.5, 0.5), (0.1, 0.5), (0.9, 0.25)])
def test_false_abort_rate_under_the_null_is_at_most_alpha(p: float, share: float):
    """Same accept rate on both arms, looked at 200 times per run: the share of runs in
    which the guard ever calls the canary worse stays within the configured rate."""
    verdicts = looks(np.random.default_rng(1), p, p, share, seeds=300, per_look=20, looks_=200)
    assert verdicts.count("worse") / len(verdicts) <= ALPHA


def test_a_clearly_worse_canary_is_caught_quickly_and_a_good_one_passes():
    rng = np.random.default_rng(2)
    worse = looks(rng, 0.6, 0.2, 0.5, seeds=50, per_look=20, looks_=50)
    assert worse.count("worse") == 50
    better = looks(rng, 0.4, 0.7, 0.5, seeds=50, per_look=20, looks_=50)
    assert better.count("non_inferior") == 50


def test_interval_by_hand():
    # 100 outcomes each, means 0.5 and 0.6: V = 2 * (25 + 0.5) / 101 / 100
    a, b = arm([1] * 50 + [0] * 50), arm([1] * 60 + [0] * 40)
    d, low, high = confidence_sequence(a, b, alpha=0.05, tau=0.1)
    v = (25.5 / 101 + 24.5 / 101) / 100
    half = (2 * v * (v + 0.01) / 0.01 * np.log(np.sqrt((v + 0.01) / v) / 0.05)) ** 0.5
    assert d == pytest.approx(0.1) and (low, high) == pytest.approx((0.1 - half, 0.1 + half))
    assert confidence_sequence(Arm(), b, 0.05, 0.1)[1] == -np.inf  # no outcomes, no bound
    few = compare("accept_rate", arm([1] * 10), arm([0] * 10), alpha=0.05, tau=0.1, margin=0.05,
                  min_samples=50)
    assert few.decision == "continue"  # too few for the normal approximation


def test_the_one_sided_lower_bound_by_hand():
    """The promotion bound is where the one-sided mixture martingale reaches 1/alpha; it
    is narrower than the two-sided interval at the same level, and about the two-sided one
    at twice the level (one tail instead of two)."""
    from math import erfc, exp, sqrt
    v, alpha, tau = 0.5 / 100, 0.05, 0.1
    u = lower_distance(v, alpha, tau)
    s = v + tau * tau
    martingale = 2 * sqrt(v / s) * exp(tau * tau * u * u / (2 * v * s)) * 0.5 * erfc(-u * tau / sqrt(2 * v * s))
    assert martingale == pytest.approx(1 / alpha, rel=1e-6)
    assert u < half_width(v, alpha, tau) and u == pytest.approx(half_width(v, 2 * alpha, tau), rel=0.01)
    a, b = arm([1] * 50 + [0] * 50), arm([1] * 60 + [0] * 40)
    look = compare("accept_rate", a, b, alpha=0.05, tau=0.1, margin=0.05, min_samples=50)
    d, low, high = confidence_sequence(a, b, alpha=0.05, tau=0.1)
    assert look.high == pytest.approx(high) and low < look.low < d


def test_a_canary_at_the_margin_is_promoted_at_most_at_the_promotion_rate():
    """A canary exactly `margin` worse than stable, looked at 200 times per run: the share
    of runs that ever promote it stays within the level of the one-sided bound."""
    rng = np.random.default_rng(3)
    verdicts = [looks(rng, 0.5, 0.45, 0.5, seeds=100, per_look=20, looks_=200) for _ in range(3)]
    promoted = sum(v.count("non_inferior") for v in verdicts)
    assert promoted / 300 <= ALPHA


def test_a_quiet_period_is_counted_from_the_last_look_with_traffic():
    from promotion.controller import QuietWatch

    watch = QuietWatch(15.0)
    assert not watch.quiet("v3", 0.0, now=100.0)  # counted from the watch's first look
    assert not watch.quiet("v3", 2.4, now=110.0)  # the gateway still routes requests
    assert not watch.quiet("v3", 0.0, now=124.0)
    assert watch.quiet("v3", 0.0, now=125.0)  # none for 15 s
    assert not watch.quiet("v4", 0.0, now=126.0)  # another canary: counted afresh


def test_traffic_too_thin_to_judge_a_canary_on_counts_as_quiet():
    """One user at night asks a few a second: below `per_s`, the canary stands down."""
    from promotion.controller import QuietWatch

    watch = QuietWatch(10.0, per_s=5.0)
    for second in range(10):  # 3 a second: under 5
        assert not watch.quiet("v3", 3.0, now=100.0 + second)
    assert watch.quiet("v3", 3.0, now=110.0)
    assert not watch.quiet("v3", 5.7, now=111.0)  # a burst: over 5


@pytest.mark.parametrize("p_stable, p_canary, verdict", [
    (0.5, 0.5, "non_inferior"), (0.3, 0.35, "non_inferior"), (0.9, 0.88, "non_inferior"),
    (0.95, 0.95, "non_inferior"), (0.5, 0.35, "worse"), (0.9, 0.8, "worse")])
def test_the_projected_samples_to_a_verdict_match_where_the_interval_gets_there(p_stable, p_canary, verdict):
    """Projected from a look at 60 per arm, with the means held where they are, the canary
    outcomes the interval needs for the verdict are within a tenth of where it gets it."""
    def look(n: int):
        return compare("accept_rate", Arm(n=n, total=p_stable * n, squares=p_stable * n),
                       Arm(n=n, total=p_canary * n, squares=p_canary * n), alpha=ALPHA, tau=TAU, margin=0.1,
                       min_samples=10)
    projected = getattr(look(60), f"to_{verdict}")
    reached = next(n for n in range(10, 5000) if look(n).decision == verdict)
    assert 0.9 * reached <= projected <= 1.1 * reached, (projected, reached)


def test_no_number_of_samples_makes_a_canary_below_the_margin_non_inferior():
    below = compare("accept_rate", Arm(n=100, total=60, squares=60), Arm(n=100, total=48, squares=48),
                    alpha=ALPHA, tau=TAU, margin=0.1, min_samples=10)
    assert below.to_non_inferior is None
