"""The learning plane on the shared stack: exactly-once learning, staleness, router
replay records, swaps under load, a corrupted version that must not serve, and the
demo in small: simulated users whose hidden preference the served policy learns."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from datetime import UTC, datetime

import httpx
import torch
from helpers import item, learner_consuming, learner_health, restart_component, serving_load, wait_for
from safetensors.torch import load_file, save_file
from test_distributed_learner import sampled
from transformers import AutoConfig

from app.demo import Population
from liverl.contracts import Topics
from liverl.kafka import encode, produce_sync
from liverl.keys import admin_headers
from liverl.pool import read_pool
from liverl.process import alive
from policies.registry import Registry
from promotion.promoter import Promoter
from promotion.sequential import wilson


def synthetic_batch(n: int, version: str, routing: tuple[int, int] | None = None) -> list[dict]:
    """Trajectories as product code would post them, each with its feedback.

    routing=(layers, top_k) attaches recorded experts per token and layer."""
    batch = []
    for i in range(n):
        cid = f"cmpl-syn-{uuid.uuid4().hex}"
        body = {"completion_id": cid, "policy_version": version, "prompt_token_ids": [5, 6, 7],
                "completion_token_ids": [8, 9, 10, 11], "completion_logprobs": [-2.0, -2.1, -1.9, -2.2]}
        if routing:  # [token][layer][k] for prompt + completion tokens
            layers, k = routing
            body["routed_experts"] = [[list(range(k)) for _ in range(layers)] for _ in range(7)]
        batch.append(item(f"t-{cid}", body, type="trajectory"))
        batch.append(item(f"f-{cid}", {"kind": "accept" if i % 2 else "reject", "completion_id": cid}))
    return batch


def restart_learner(settings, fault: str | None = None, env: dict[str, str] | None = None) -> int:
    return restart_component(settings, "learner", dict({"LIVERL_FAULT": fault} if fault else {}, **(env or {})))


# Two durable steps where a kill matters for exactly-once: a version directory not yet
# registered, a version whose Kafka offsets were not committed. (The others, every
# `crash_point` in learner/, policies/registry.py and sync/transport.py, are each a restart
# of about a minute here: kept out of the suite's time.)
KILLED_AT = ("registry.publish.after_rename", "learner.after_publish")


def exited(pid: int) -> bool:
    """`pid` has exited (the supervisor then starts the learner again, without the fault)."""
    return not alive(pid)


def test_a_learner_killed_at_each_durable_step_learns_every_sample_exactly_once(settings, api):
    registry = Registry(settings.policies_dir)
    before = registry.latest().seq
    sent: list[dict] = []
    wait_for(lambda: learner_consuming(settings), timeout=120)
    for fault in KILLED_AT:
        pid = restart_learner(settings, fault=fault)
        # What the last one left unlearned is learned first: it may die at `fault` on that.
        health = wait_for(lambda pid=pid: exited(pid) or learner_consuming(settings), timeout=120)
        if health is not True:
            batch = synthetic_batch(settings.learner.batch_samples, health["version"])
            assert api.post("/v1/ingestion", json={"batch": batch}).json()["rejected"] == 0
            sent += batch
            wait_for(lambda pid=pid: exited(pid), timeout=120)  # it learned, then died at `fault`
    restart_learner(settings)
    wait_for(lambda: learner_consuming(settings), timeout=120)
    ids = sorted({f"dev:{b['body']['completion_id']}" for b in sent if b["type"] == "trajectory"})

    def all_learned() -> bool:
        httpx.post(settings.url(settings.ports.learner) + "/flush", headers=admin_headers(settings), timeout=10)
        return registry.trained(ids) == set(ids)
    wait_for(all_learned, timeout=120, interval=2)
    # Each sample in exactly one version's record (a record that would keep a repeat).
    assert registry.times_learned(ids) == dict.fromkeys(ids, 1)
    windows = [v.window for v in registry.versions() if v.seq > before and v.window]
    assert sum(w.samples for w in windows) >= len(ids)
    # Training resumes from the newest version's optimizer state; a version's state is
    # kept as long as retention keeps its weights (a rewind goes back to it).
    def states_follow_retention() -> bool:
        states = {p.stem for p in (settings.data_dir / "learner").glob("*.pt")}
        return registry.latest().version in states and all(
            (settings.policies_dir / version).exists() for version in states)
    wait_for(states_follow_retention, timeout=30)


def test_stale_samples_are_dropped_and_counted(settings, api):
    registry = Registry(settings.policies_dir)
    while registry.steps_apart("v0", registry.head().version, settings.learner.max_version_lag) is not None:
        seq = registry.latest().seq
        api.post("/v1/ingestion", json={"batch": synthetic_batch(
            settings.learner.batch_samples, registry.latest().version)})
        wait_for(lambda seq=seq: registry.latest().seq > seq, timeout=120)
    start = registry.latest().seq
    stale = synthetic_batch(8, "v0")
    fresh = synthetic_batch(settings.learner.batch_samples, registry.latest().version)
    api.post("/v1/ingestion", json={"batch": stale + fresh})
    wait_for(lambda: any(v.window and v.window.dropped_stale for v in registry.versions() if v.seq > start),
             timeout=120)
    stale_ids = {f"dev:{b['body']['completion_id']}" for b in stale if b["type"] == "trajectory"}
    assert registry.trained(sorted(stale_ids)) == set()
    # Each dropped by id, recorded with the offsets that consumed it.
    wait_for(lambda: registry.dropped(sorted(stale_ids)) == dict.fromkeys(stale_ids, "stale"), timeout=60)


def test_samples_that_waited_too_long_are_dropped_by_id_and_fresh_ones_trained(settings, api, starter_dir):
    """A learner that fell behind skips what waited on the samples topic longer than
    `learner.max_sample_wait_s` (stale, recorded by id) and trains what is fresh: its place
    in the log, which retention must keep, stays recent (docs/reliability.md, the soak)."""
    registry = Registry(settings.policies_dir)
    version = registry.latest().version
    assert settings.learner.max_sample_wait_s is not None
    waited = datetime.fromtimestamp(time.time() - 2 * settings.learner.max_sample_wait_s, UTC)
    marker = uuid.uuid4().hex[:8]
    samples = []
    for i, sample in enumerate(sampled(starter_dir, count=settings.learner.batch_samples + 8)):
        old = i < 8
        name = f"acme:{'old' if old else 'new'}-{marker}-{i}"
        samples.append(sample.model_copy(update={
            "sample_id": name, "event_id": f"{name}:r0", "timestamp": waited if old else sample.timestamp,
            "trajectory": sample.trajectory.model_copy(update={"policy_version": version})}))
    for sample in samples:
        produce_sync(settings, Topics.SAMPLES, encode(sample))
    old_ids, new_ids = [s.sample_id for s in samples[:8]], [s.sample_id for s in samples[8:]]
    wait_for(lambda: registry.dropped(old_ids) == dict.fromkeys(old_ids, "stale"), timeout=180)
    wait_for(lambda: registry.trained(new_ids), timeout=180)
    assert registry.trained(old_ids) == set()
    assert not registry.dropped(new_ids)


def test_router_replay_mismatch_is_recorded_per_version(settings, api):
    registry = Registry(settings.policies_dir)
    start = registry.latest().seq
    config = AutoConfig.from_pretrained(registry.latest().model_dir)
    api.post("/v1/ingestion", json={"batch": synthetic_batch(
        settings.learner.batch_samples, registry.latest().version,
        routing=(config.num_hidden_layers, config.num_experts_per_tok))})
    version = wait_for(lambda: next((v for v in registry.versions() if v.seq > start
                                     and v.metrics.get("router_replay")), None), timeout=120)
    assert version.metrics["trained_routing_mismatch_fraction"] == 0.0  # by construction
    assert 0.0 <= version.metrics["routing_mismatch_fraction"] <= 1.0
    assert version.metrics["logprob_mismatch_max"] >= version.metrics["logprob_mismatch_mean"] >= 0


def test_swap_under_load_drops_no_request(settings, dev_keys, paused_learner):
    registry = Registry(settings.policies_dir)
    target = registry.latest()
    if read_pool(settings).replicas[0].policy_version == target.version:
        target = registry.get(target.parent)
    assert len(read_pool(settings).replicas) >= 2, "the test stack runs several replicas"
    with serving_load(settings, dev_keys["tenant_key"]) as statuses:
        result = Promoter(settings, registry).promote(target.version, "test")
    assert result.state == "stable"
    assert set(statuses) == {200}
    assert all(r.policy_version == target.version for r in read_pool(settings).replicas)
    swaps = registry.get(target.version).metrics["swaps"]
    assert [s["replica"] for s in swaps] == [r.name for r in read_pool(settings).replicas]  # canary first
    for swap in swaps:
        assert swap["ok"] and swap["max_logprob_diff"] <= settings.learner.probe_tolerance
        assert 0 < swap["load_s"] <= swap["pause_s"]  # the serving pause is measured per replica


def test_corrupted_version_fails_verification_and_is_reverted(settings, paused_learner):
    registry = Registry(settings.policies_dir)
    serving = read_pool(settings).replicas[0]
    staged = settings.policies_dir / "staging-corrupt"
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(serving.model_dir, staged)
    weights = staged / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if "experts" in k)
    tensors[name] = tensors[name] + torch.randn_like(tensors[name].float()).to(tensors[name].dtype)
    weights.chmod(0o644)
    save_file(tensors, weights, metadata={"format": "pt"})
    corrupt = registry.publish(staged, parent=serving.policy_version, window=None, metrics={},
                               sample_ids=[], actor="test")
    result = Promoter(settings, registry).promote(corrupt.version, "test")
    assert result.state == "rolled_back"
    swap = registry.get(corrupt.version).metrics["swaps"][0]
    assert not swap["ok"] and swap["reverted"] and "probe logprobs differ" in swap["error"]
    # The canary failed, so no replica ever got to serve the corrupted version.
    assert {r.policy_version for r in read_pool(settings).replicas} == {serving.policy_version}
    assert len(registry.get(corrupt.version).metrics["swaps"]) == 1
    history = registry.history(corrupt.version)
    assert [h["to"] for h in history] == ["candidate", "canary", "rolled_back"]


def test_rollback_returns_the_previous_stable_version_everywhere(settings, paused_learner):
    registry = Registry(settings.policies_dir)
    current = registry.stable()
    restored = Promoter(settings, registry).rollback("test", "accept rate dropped")
    assert restored.version != current.version and restored.state == "stable"
    assert registry.get(current.version).state == "rolled_back"
    assert {r.policy_version for r in read_pool(settings).replicas} == {restored.version}
    assert registry.history(restored.version)[-1]["reason"].startswith(f"rollback from {current.version}")


def test_a_short_demo_run_raises_the_accept_rate(settings, dev_keys):
    """The demo in small: simulated users teach the served policy their hidden rule."""
    population = Population(settings, dev_keys["tenant_key"], users=4, seed=1, max_tokens=24)
    threads = population.start()

    def verdicts() -> list[bool]:
        with population._lock:
            return [ok for _, ok in sorted(e for t in population.tallies.values() for e in t.log)]

    def risen() -> bool:
        seen = verdicts()
        return len(seen) >= 200 and wilson(sum(seen[-80:]), 80)[0] > wilson(sum(seen[:80]), 80)[1]
    try:
        wait_for(risen, timeout=300, interval=5)
    finally:
        population.stop(threads)
    assert population.errors == 0


def test_a_candidate_too_far_from_stable_sends_the_learner_back_to_stable(settings, api):
    registry = Registry(settings.policies_dir)
    restart_learner(settings, env={"LIVERL_LEARNER__GATE_MAX_KL": "1e-12"})  # any step is too far
    try:
        current = wait_for(lambda: learner_health(settings), timeout=60)["version"]
        start = registry.latest().seq
        api.post("/v1/ingestion", json={"batch": synthetic_batch(settings.learner.batch_samples, current)})
        far = wait_for(lambda: next((v for v in registry.versions() if v.seq > start and (v.metrics.get("gate") or {})
                                     .get("reason", "").startswith("moved too far from stable")), None), timeout=120)
        assert far.metrics["gate"]["passed"] is False and far.metrics["gate"]["kl_from_stable"] > 1e-12
        rewind = registry.last_rewind()
        assert rewind.actor == "learner" and far.version in rewind.reason
        # Back to what users were getting then (the controller may have promoted meanwhile).
        assert rewind.version != far.version and "stable" in {e["to"] for e in registry.history(rewind.version)}
        wait_for(lambda: learner_health(settings)["version"] == rewind.version, timeout=60)
        # The next version grows from the rewind's, and its optimizer state is kept under its own name
        # (not under the name of the version after the rewind's, which exists already).
        api.post("/v1/ingestion", json={"batch": synthetic_batch(settings.learner.batch_samples, rewind.version)})
        child = wait_for(lambda: next((v for v in registry.versions() if v.parent == rewind.version
                                       and v.seq > far.seq), None), timeout=120)
        assert (settings.data_dir / "learner" / f"{child.version}.pt").exists()
    finally:
        restart_learner(settings)


def test_a_sized_group_is_trained_only_whole_and_in_one_version(settings, api):
    """Rollout groups carry their size: a group missing a member waits (it is never trained
    half-scored), and once whole all its members train in the same version."""
    registry = Registry(settings.policies_dir)
    version = wait_for(lambda: learner_health(settings), timeout=60)["version"]

    def group(n: int) -> tuple[list[dict], list[str]]:
        gid = f"grp-{uuid.uuid4().hex}"
        items = synthetic_batch(n, version)
        for it in items:
            if it["type"] == "trajectory":
                it["body"].update(group_id=gid, group_size=4)
        return items, [f"dev:{it['body']['completion_id']}" for it in items if it["type"] == "trajectory"]

    whole, whole_ids = group(4)
    cut, cut_ids = group(3)
    assert api.post("/v1/ingestion", json={"batch": whole + cut}).json()["rejected"] == 0

    def trained(ids: list[str]) -> bool:
        httpx.post(settings.url(settings.ports.learner) + "/flush", headers=admin_headers(settings), timeout=10)
        return registry.trained(ids) == set(ids)
    wait_for(lambda: trained(whole_ids), timeout=120, interval=2)
    assert registry.trained(cut_ids) == set()
    # The missing member arrives: the whole group trains, together.
    last = synthetic_batch(1, version)
    last[0]["body"].update(group_id=cut[0]["body"]["group_id"], group_size=4)
    api.post("/v1/ingestion", json={"batch": last})
    cut_ids.append(f"dev:{last[0]['body']['completion_id']}")
    wait_for(lambda: trained(cut_ids), timeout=120, interval=2)
    versions = {row[0] for row in registry.db.execute(
        f"SELECT version FROM trained_samples WHERE sample_id IN ({','.join('?' * 4)})", cut_ids)}
    assert len(versions) == 1
    # A size without a group is refused at the door, naming the field.
    lone = synthetic_batch(1, version)
    lone[0]["body"]["group_size"] = 4
    answer = api.post("/v1/ingestion", json={"batch": lone}).json()
    assert answer["rejected"] == 1 and "group_size needs a group_id" in json.dumps(answer)
