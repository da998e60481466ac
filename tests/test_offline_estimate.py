"""The off-policy estimate a team reads before a policy takes traffic: its 95% interval
must cover the true mean reward of a known policy on simulated logs, also when the
importance weights are capped."""

import math
import statistics

import pytest
import torch

from policies.offline_eval import capped_is


def logged_bandit(seed: int, shift: float, n: int = 400, actions: int = 8):
    """Logs of a behaviour policy mu over `actions` actions with Bernoulli rewards, and a
    target policy pi tilted toward the better actions by `shift` (larger: further from mu)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.softmax(torch.randn(actions, generator=g) * 0.5, 0)
    reward_prob = torch.rand(actions, generator=g)
    pi = torch.softmax(mu.log() + shift * (reward_prob - reward_prob.mean()), 0)
    logged = torch.multinomial(mu, n, replacement=True, generator=g)
    rewards = (torch.rand(n, generator=g) < reward_prob[logged]).float()
    true_value = (pi * reward_prob).sum().item()
    return (pi[logged] / mu[logged]).log(), rewards, true_value, (pi / mu).max().item()


@pytest.mark.parametrize("shift,cap", [(3.0, 10.0), (6.0, 2.0)])
def test_the_interval_covers_the_true_reward_in_at_least_92_percent_of_500_seeds(shift, cap):
    covered, widths, capped = 0, [], 0
    for seed in range(500):
        log_ratio, rewards, truth, max_ratio = logged_bandit(seed, shift)
        estimate = capped_is(log_ratio, rewards, cap=cap)
        covered += estimate.low <= truth <= estimate.high
        widths.append(estimate.high - estimate.low)
        capped += max_ratio > cap
    assert covered / 500 >= 0.92
    assert statistics.median(widths) < 0.5  # an interval that says something
    if cap == 2.0:
        assert capped > 250  # the cap bites in most runs, and the interval still covers


def test_capped_is_by_hand():
    # weights 0.5, 1, 4 -> capped at 2: 0.5, 1, 2; rewards 1, 0, 1.
    estimate = capped_is(torch.tensor([0.5, 1.0, 4.0]).log(), torch.tensor([1.0, 0.0, 1.0]), cap=2.0, z=0.0)
    assert estimate.value == pytest.approx((0.5 + 0 + 2) / 3)
    assert estimate.missing_mass == pytest.approx(0.0)  # mean capped weight 3.5/3 > 1: nothing missing
    estimate = capped_is(torch.tensor([0.25, 0.25, 4.0]).log(), torch.tensor([1.0, 0.0, 1.0]), cap=2.0, z=0.0)
    assert estimate.missing_mass == pytest.approx(1 - 2.5 / 3)
    assert estimate.low == pytest.approx(2.25 / 3)
    assert estimate.high == pytest.approx(2.25 / 3 + (1 - 2.5 / 3))
    assert not math.isnan(estimate.high)
