"""What a researcher looks at to see a collapse coming is recorded with every version:
how far it moved from its parent, its entropy, the gradient norms, the advantages."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_distributed_learner import sampled

from learner.trainer import Trainer
from liverl.settings import LearnerConfig


def test_a_version_records_how_far_it_moved_from_its_parent(starter_dir: Path):
    samples = sampled(starter_dir, count=6)
    small, large = (Trainer(starter_dir, LearnerConfig(minibatch=3, lr=lr)).train(samples) for lr in (1e-7, 1e-3))
    # Adam moves every weight by about lr per step, so the KL grows about as lr squared.
    assert 0 <= small["kl_from_parent"] < large["kl_from_parent"] / 100
    for metrics in (small, large):
        assert metrics["entropy"] > 0
        assert 0 < metrics["grad_norm"] <= metrics["grad_norm_max"]
        assert {"advantage_mean", "advantage_std", "advantage_abs_max", "advantage_zero_fraction"} <= set(metrics)


@pytest.mark.parametrize("objective", ["ppo", "gspo", "cispo"])
def test_trust_region_objectives_train_on_the_policy(starter_dir: Path, objective: str):
    """Each objective takes real steps on the starter (its parent as the proximal policy,
    router replay and all) and reports its clipping; the clipping itself is checked by
    hand in tests/test_learner_math.py."""
    samples = sampled(starter_dir, count=6)
    metrics = Trainer(starter_dir, LearnerConfig(minibatch=2, lr=1e-3, epochs=2, objective=objective)).train(samples)
    assert 0 <= metrics["clipped_fraction"] <= 1 and metrics["untrainable"] == {}
    assert metrics["kl_from_parent"] > 0 and metrics["mean_is_weight"] > 0
