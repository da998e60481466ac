"""No sample can stop learning: malformed ones are refused before training, and one that
still breaks a step is found by trying each sample alone, dead-lettered and skipped."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from helpers import sql, wait_for
from test_distributed_learner import sampled

from learner.trainer import Trainer, problem
from liverl.audit import AuditLog
from liverl.contracts import Architecture, RewardedSample, Topics, Trajectory
from liverl.kafka import encode, produce_sync
from liverl.keys import KeyStore, admin_headers
from liverl.settings import LearnerConfig
from policies.registry import Registry

ARCH = Architecture(vocab_size=100, layers=2, experts=4, top_k=2)


def bad(sample: RewardedSample, **trajectory) -> RewardedSample:
    """`sample` with its trajectory changed, validated as the learner reads it off the topic."""
    changed = Trajectory.model_validate({**sample.trajectory.model_dump(), **trajectory})
    return sample.model_copy(update={"trajectory": changed})


def good_sample() -> RewardedSample:
    t = Trajectory(event_id="t", tenant="acme", completion_id="c", policy_version="v0",
                   prompt_token_ids=[1, 2], completion_token_ids=[3, 4], completion_logprobs=[-1.0, -2.0],
                   routed_experts=[[[0, 1], [2, 3]]] * 4)
    return RewardedSample(sample_id="acme:c", event_id="acme:c:r0", tenant="acme", reward=1.0,
                          reward_source="feedback", reward_fn_version="test", trajectory=t)


BAD_SHAPES = {
    "token id past the vocabulary": dict(completion_token_ids=[3, 10_000_000]),
    "negative token id": dict(prompt_token_ids=[-1, 2]),
    "routing for too many tokens": dict(routed_experts=[[[0, 1], [2, 3]]] * 5),
    "routing with a missing layer": dict(routed_experts=[[[0, 1]]] * 4),
    "routing with too few experts per token": dict(routed_experts=[[[0], [2]]] * 4),
    "expert id out of range": dict(routed_experts=[[[0, 9], [2, 3]]] * 4),
    "negative expert id": dict(routed_experts=[[[0, -1], [2, 3]]] * 4),
    "positive logprob": dict(completion_logprobs=[-1.0, 3.0]),
}


def test_the_checks_name_each_bad_shape():
    assert problem(good_sample(), ARCH) is None
    for name, change in BAD_SHAPES.items():
        assert problem(bad(good_sample(), **change), ARCH) is not None, name


def test_a_step_that_breaks_is_retried_sample_by_sample(starter_dir: Path):
    """The trainer itself, without the checks: a sample torch cannot take (an id past the
    embedding) breaks its minibatch; the others still train, the culprit is named."""
    samples = sampled(starter_dir, count=6)
    poison = bad(samples[2], completion_token_ids=[10_000_000] * len(samples[2].trajectory.completion_token_ids))
    samples[2] = poison.model_copy(update={"sample_id": "acme:poison"})
    trainer = Trainer(starter_dir, LearnerConfig(minibatch=6, lr=1e-3))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train(samples)
    assert list(metrics["untrainable"]) == ["acme:poison"]
    assert "IndexError" in metrics["untrainable"]["acme:poison"] or "index" in metrics["untrainable"]["acme:poison"]
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the good five trained


def test_optimizer_state_round_trips_without_unpickling(starter_dir: Path, tmp_path: Path):
    trainer = Trainer(starter_dir, LearnerConfig(minibatch=4, lr=1e-3))
    trainer.train(sampled(starter_dir, count=4))
    trainer.save_state(tmp_path / "v1.pt")
    resumed = Trainer(starter_dir, LearnerConfig(minibatch=4, lr=1e-3), tmp_path / "v1.pt")  # weights_only=True
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.state_dict().values(),
                                                 resumed.model.state_dict().values(), strict=True))
    assert resumed.baseline.means == trainer.baseline.means


def test_groups_are_scoped_by_tenant(starter_dir: Path):
    trainer = Trainer(starter_dir, LearnerConfig())
    samples = sampled(starter_dir, count=4)
    rewards = [1.0, 0.0, 1.0, 1.0]
    tenants = ["acme", "acme", "globex", "globex"]
    samples = [s.model_copy(update={"reward": r, "tenant": t,
                                    "trajectory": s.trajectory.model_copy(update={"group_id": "g1"})})
               for s, r, t in zip(samples, rewards, tenants, strict=True)]
    advantages = trainer.advantages(samples)
    # acme's group is (1, 0): +1 and -1. globex's (1, 1) teaches nothing; shared with acme's
    # it would have been pulled above a common mean of 0.75.
    assert advantages.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-4)


def test_learner_control_needs_an_admin_key_and_is_audited(settings, stack, dev_keys):
    url = settings.url(settings.ports.learner)
    assert httpx.post(url + "/pause", timeout=10).status_code == 401
    tenant = {"Authorization": f"Bearer {dev_keys['tenant_key']}"}
    for verb in ("pause", "resume", "flush"):
        assert httpx.post(f"{url}/{verb}", headers=tenant, timeout=10).status_code == 403
    reason = f"maintenance {uuid.uuid4().hex[:6]}"
    paused = httpx.post(url + "/pause", params={"reason": reason}, headers=admin_headers(settings),
                        timeout=620).json()
    # Answered once the step in flight is done: nothing is written after it.
    assert paused["paused"] is True and paused["halted"] is True
    published = len(Registry(settings.policies_dir).versions())
    time.sleep(3)
    assert len(Registry(settings.policies_dir).versions()) == published
    assert httpx.post(url + "/resume", params={"reason": reason}, headers=admin_headers(settings),
                      timeout=10).json()["paused"] is False
    admin_id = next(r.key_id for r in KeyStore(settings.keys_file).list() if r.role == "admin")
    entries = [(e.actor, e.action) for e in AuditLog(settings.audit_file).entries(action=None) if e.reason == reason]
    assert entries == [(admin_id, "learner.pause"), (admin_id, "learner.resume")]


def test_poison_samples_are_dead_lettered_while_good_ones_train(settings, stack, starter_dir):
    """The learner's own defence, so the bad samples go straight onto the samples topic
    (the ingest API refuses them at the door)."""
    registry = Registry(settings.policies_dir)
    start = registry.latest()
    good = sampled(starter_dir, count=settings.learner.batch_samples)
    marker = uuid.uuid4().hex[:8]
    poison = []
    for i, change in enumerate(BAD_SHAPES.values()):
        change = {k: v for k, v in change.items() if k != "routed_experts"} or {
            "routed_experts": [[[0] * 99] * 99]}  # any routing wrong for the starter's shape
        sample = bad(good[i], **change, policy_version=start.version)
        poison.append(sample.model_copy(update={"sample_id": f"acme:poison-{marker}-{i}",
                                                "event_id": f"acme:poison-{marker}-{i}:r0"}))
    for i, sample in enumerate(good):
        good[i] = sample.model_copy(update={
            "sample_id": f"acme:good-{marker}-{i}", "event_id": f"acme:good-{marker}-{i}:r0",
            "trajectory": sample.trajectory.model_copy(update={"policy_version": start.version})})
    for sample in poison + good:
        produce_sync(settings, Topics.SAMPLES, encode(sample))
    version = wait_for(lambda: next((v for v in registry.versions() if v.seq > start.seq
                                     and v.window and v.window.samples >= len(good) // 2), None), timeout=180)
    assert version.metrics["dropped"]["malformed"] >= len(poison)
    query = (f"SELECT reason FROM dead_letters WHERE source_topic = '{Topics.SAMPLES}' "
             f"AND position(payload, 'poison-{marker}') > 0")
    letters = wait_for(lambda: (rows := sql(settings, query))
                       and len(rows) == len(poison) and rows, timeout=60)
    assert all(r["reason"].startswith("malformed") for r in letters)
    assert httpx.get(settings.url(settings.ports.learner) + "/health", timeout=10).json()["ok"]
