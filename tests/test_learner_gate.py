"""The offline gate's parent half: each version's gate reuses what its parent's gate
computed on the same held-out samples, and gets the same figures as computing them anew."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from test_distributed_learner import sampled

from learner.service import Learner
from learner.trainer import Trainer
from liverl.settings import LearnerConfig


def test_the_parent_half_of_the_gate_is_reused_and_equal_to_a_fresh_one(starter_dir: Path):
    samples = sampled(starter_dir, 12)
    learner = Learner.__new__(Learner)  # the gate's bookkeeping alone: no broker, no registry
    learner.trainer = Trainer(starter_dir, LearnerConfig(lr=1e-3, minibatch=4))
    learner.holdout = samples[:8]
    learner.current = SimpleNamespace(version="v1")
    # v1's gate computed these when v1 was the candidate; v2 trains on top of it.
    ratios = learner.trainer.mean_log_ratios(learner.holdout).tolist()
    learner.holdout_ratios = ("v1", {s.event_id: r for s, r in zip(learner.holdout, ratios, strict=True)})
    learner.trainer.train(samples[8:], seed=0)
    learner.holdout = samples[:10]  # two held out since

    calls = []
    fresh = learner.trainer.mean_log_ratios(learner.holdout, of_parent=True)
    assert not torch.allclose(fresh, learner.trainer.mean_log_ratios(learner.holdout))  # v2 moved
    original = learner.trainer.mean_log_ratios
    learner.trainer.mean_log_ratios = lambda held, of_parent=False: calls.append(len(held)) or original(held, of_parent)
    reused = learner.parent_log_ratios()
    assert calls == [2]  # only the two new samples went through the model
    assert torch.allclose(reused, fresh, atol=1e-5)

    learner.current = SimpleNamespace(version="v0")  # a rewind: the kept figures are another version's
    calls.clear()
    assert torch.allclose(learner.parent_log_ratios(), fresh, atol=1e-5)
    assert calls == [10]
