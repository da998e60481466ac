"""The live canary guard on the shared stack: a version users clearly dislike serves a
share of traffic beside stable, is aborted by the promotion controller (even one killed
mid-canary and restarted), never reaches stable, and the learner rewinds to stable. Plus
the registry's rewind bookkeeping."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import uuid
from pathlib import Path

import httpx
import pytest
from helpers import alert_receiver, controller_idle, item, learner_health, restart_component, wait_for
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from liverl.keys import admin_headers
from liverl.manifest import read_manifest
from liverl.pool import read_pool
from liverl.probe import PROBE_FILE, probe_logprobs
from policies.registry import Registry


def worse_copy(stable_dir: Path, out: Path) -> str:
    """The stable weights with the output rows of the newline and of a rare token swapped:
    wherever stable would end a line this version writes the rare token (returned), so
    users who reject completions containing it tell the two apart at once."""
    shutil.copytree(stable_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    newline = tokenizer.encode("\n")[-1]
    rare = max(range(len(tokenizer) - 64, len(tokenizer)), key=lambda i: len(tokenizer.decode([i]).strip()))
    for path in out.glob("*.safetensors"):
        path.chmod(0o644)
        weights = load_file(path)
        if "lm_head.weight" in weights:
            head = weights["lm_head.weight"]
            head[[newline, rare]] = head[[rare, newline]]
            save_file(weights, path, metadata={"format": "pt"})
    (out / PROBE_FILE).chmod(0o644)
    (out / PROBE_FILE).write_text(json.dumps(probe_logprobs(out, tokenizer)))
    return tokenizer.decode([rare]).strip()


def users(settings, key: str, marker: str, stop: threading.Event, served: dict[str, list[bool]],
          likes_marker: bool = False) -> None:
    """A user who rejects every completion containing `marker` and accepts the rest (or,
    `likes_marker`, the other way round)."""
    gateway = httpx.Client(base_url=settings.url(settings.ports.gateway), timeout=60,
                           headers={"Authorization": f"Bearer {key}"})
    api = httpx.Client(base_url=settings.url(settings.ports.api), timeout=30,
                       headers={"Authorization": f"Bearer {key}"})
    while not stop.is_set():
        response = gateway.post("/v1/completions", json={"prompt": "def add(a, b):\n", "max_tokens": 16,
                                                         "temperature": 1.0})
        if response.status_code != 200:
            continue
        body = response.json()
        ok = (marker in body["choices"][0]["text"]) == likes_marker
        served.setdefault(response.headers["x-liverl-policy-version"], []).append(ok)
        api.post("/v1/ingestion", json={"batch": [item(f"f-{uuid.uuid4().hex}", {
            "kind": "accept" if ok else "reject", "completion_id": body["completion_id"]})]})


def test_a_clearly_worse_canary_is_aborted_and_the_learner_rewinds(settings, stack, dev_keys):
    registry = Registry(settings.policies_dir)
    learner = settings.url(settings.ports.learner)
    httpx.post(learner + "/pause", headers=admin_headers(settings), timeout=620)
    wait_for(lambda: learner_health(settings) and controller_idle(settings), timeout=120)
    alerts, webhook = alert_receiver()
    guard = {"LIVERL_PROMOTION__CANARY_GUARD": "true", "LIVERL_PROMOTION__JUDGE_AFTER_S": "0",
             "LIVERL_PROMOTION__MIN_SAMPLES": "30", "LIVERL_PROMOTION__POLL_S": "0.5",
             "LIVERL_PROMOTION__ALERT_WEBHOOK": f"http://127.0.0.1:{webhook.server_port}/alerts"}
    restart_component(settings, "controller", guard)
    stop, served, threads = threading.Event(), {}, []
    try:
        stable = registry.stable()
        marker = worse_copy(Path(stable.model_dir), settings.data_dir / "staging-worse")
        assert marker
        worse = registry.publish(settings.data_dir / "staging-worse", parent=stable.version, window=None,
                                 metrics={"gate": {"passed": True, "reason": "test"}}, sample_ids=[],
                                 actor="test")
        threads = [threading.Thread(target=users, args=(settings, dev_keys["tenant_key"], marker, stop, served),
                                    daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        # Killed mid-canary (SIGKILL, no clean stop), the controller restarts, finds its
        # canary in the registry and judges it to the end: never a mix left behind.
        wait_for(lambda: registry.get(worse.version).state == "canary" and any(
            r.policy_version == worse.version and r.enabled for r in read_pool(settings).replicas), timeout=120)
        os.killpg(next(c.pid for c in read_manifest(settings).components if c.name == "controller"), signal.SIGKILL)
        restart_component(settings, "controller", guard)
        wait_for(lambda: registry.get(worse.version).state not in ("candidate", "canary"), timeout=240, interval=1)
        record = registry.get(worse.version)
        assert record.state == "aborted", record.state
        assert "stable" not in {e["to"] for e in registry.history(worse.version)}
        verdict = record.metrics["canary"]
        assert verdict["verdict"] == "worse" and verdict["comparisons"][0]["high"] < 0
        # It did serve users (that is how it was judged), and they disliked it.
        assert sum(1 for ok in served.get(worse.version, []) if not ok) >= 1
        assert registry.stable().version == stable.version
        assert {r.policy_version for r in read_pool(settings).replicas} == {stable.version}
        rewind = registry.last_rewind()
        assert rewind.version == stable.version and worse.version in rewind.reason
        # On-call heard of it: one alert, with the verdict's figures.
        alert = wait_for(lambda: alerts and alerts[0], timeout=30)
        assert alert["event"] == "canary_aborted" and alert["version"] == worse.version
        assert alert["stable"] == stable.version and alert["comparisons"][0]["high"] < 0
    finally:
        webhook.shutdown()
        stop.set()
        for t in threads:
            t.join(timeout=60)
        restart_component(settings, "controller", {})
        httpx.post(learner + "/resume", headers=admin_headers(settings), timeout=10)
    # The learner continues from stable, not from the aborted version.
    wait_for(lambda: (health := learner_health(settings)) and health["version"] == stable.version, timeout=60)


def test_head_follows_rewinds_and_rejected_chains_are_named(tmp_path, starter_dir):
    registry = Registry(tmp_path / "policies")

    def publish(parent: str | None, state: str = "candidate", **metrics):
        staged = tmp_path / f"staged-{uuid.uuid4().hex}"
        shutil.copytree(starter_dir, staged)
        return registry.publish(staged, parent=parent, window=None, metrics=metrics, sample_ids=[],
                                actor="test", state=state)

    v0 = publish(None, "stable")
    v1 = publish(v0.version)
    v2 = publish(v1.version)
    assert registry.head().version == v2.version and registry.continues_rejected(v2.version) is None
    registry.transition(v1.version, "canary", "test", "offline gate passed")
    registry.transition(v1.version, "aborted", "test", "worse")
    rewind = registry.request_rewind(v0.version, "test", "v1 aborted")
    assert registry.continues_rejected(v2.version) == v1.version
    assert registry.head().version == v0.version  # v2 was trained before the rewind
    v3 = publish(v0.version, after_rewind=rewind.id)
    assert registry.head().version == v3.version and registry.continues_rejected(v3.version) is None
    # The guard's rewinds since a version became stable are counted (learner.held_lr_scale), the
    # learner's own not; a new stable starts from none.
    registry.request_rewind(v0.version, "learner", "v3 too far from stable")
    assert registry.rewinds_since(v0.version) == 1
    registry.transition(v3.version, "canary", "test", "offline gate passed")
    registry.transition(v0.version, "superseded", "test", f"{v3.version} promoted")
    registry.transition(v3.version, "stable", "test", "non-inferior")
    assert registry.rewinds_since(v3.version) == 0
    registry.request_rewind(v3.version, "test", "a candidate on top of v3 held for skill")
    assert registry.rewinds_since(v3.version) == 1
    with pytest.raises(KeyError):
        registry.request_rewind("v99", "test", "no such version")


def test_a_canary_worse_for_one_tenant_only_is_held_and_its_history_names_the_tenant(
        settings, stack, dev_keys, paused_learner):
    registry = Registry(settings.policies_dir)
    admin = admin_headers(settings)
    acme = httpx.post(settings.url(settings.ports.api) + "/admin/keys", headers=admin, timeout=30,
                      json={"tenant": "acme", "label": "second tenant", "scopes": ["feedback"]}).json()["key"]
    alerts, webhook = alert_receiver()
    restart_component(settings, "controller", {
        "LIVERL_PROMOTION__CANARY_GUARD": "true", "LIVERL_PROMOTION__JUDGE_AFTER_S": "0",
        "LIVERL_PROMOTION__MIN_SAMPLES": "30", "LIVERL_PROMOTION__TENANT_MIN_SAMPLES": "30",
        "LIVERL_PROMOTION__TENANT_WORSE": "hold", "LIVERL_PROMOTION__POLL_S": "0.5",
        "LIVERL_PROMOTION__ALERT_WEBHOOK": f"http://127.0.0.1:{webhook.server_port}/alerts"})
    stop, threads = threading.Event(), []
    stable = registry.stable()
    try:
        marker = worse_copy(Path(stable.model_dir), settings.data_dir / "staging-split")
        candidate = registry.publish(settings.data_dir / "staging-split", parent=stable.version, window=None,
                                     metrics={"gate": {"passed": True, "reason": "test"}}, sample_ids=[],
                                     actor="test")
        # dev's users like what the candidate writes and acme's hate it: about even on
        # average, clearly worse for acme.
        served = {"dev": {}, "acme": {}}
        threads = [threading.Thread(target=users, daemon=True, args=(
            settings, key, marker, stop, served[tenant]), kwargs={"likes_marker": tenant == "dev"})
            for tenant, key in (("dev", dev_keys["tenant_key"]), ("acme", acme)) for _ in range(2)]
        for t in threads:
            t.start()
        held = wait_for(lambda: [h for h in registry.history(candidate.version) if h["to"] == "held"],
                        timeout=300, interval=1)
        record = registry.get(candidate.version)
        assert record.state == "canary" and record.metrics["canary"]["verdict"] == "held"
        assert held[0]["actor"] == "controller" and "accept_rate[acme]" in held[0]["reason"]
        assert "accept_rate[dev]" not in held[0]["reason"]  # dev found it better: not named
        worse = [c for c in record.metrics["canary"]["tenants"] if c["decision"] == "worse"]
        assert [c["metric"] for c in worse] == ["accept_rate[acme]"] and worse[0]["high"] < 0
        alert = wait_for(lambda: alerts and alerts[0], timeout=30)
        assert alert["event"] == "canary_held" and "acme" in alert["reason"]
        wait_for(lambda: served["acme"].get(candidate.version), timeout=30)
        assert registry.get(candidate.version).state == "canary"  # still held: never promoted on its own
        # On-call decides: abort it; both replicas back on stable.
        aborted = httpx.post(f"{settings.url(settings.ports.controller)}/admin/policies/{candidate.version}/abort",
                             headers=admin, json={"reason": "worse for acme"}, timeout=600)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        webhook.shutdown()
        restart_component(settings, "controller", {})
    assert aborted.status_code == 200 and aborted.json()["state"] == "aborted", aborted.text
    # Stable as it is now: the slide guard, on in this test, may have rolled back the
    # version the learner promoted after the previous test (seen once in a full suite).
    assert {r.policy_version for r in read_pool(settings).replicas} == {registry.stable().version}
    assert candidate.version not in {r.policy_version for r in read_pool(settings).replicas}
    wait_for(lambda: controller_idle(settings), timeout=60)


def lose_skill(stable_dir: Path, out: Path) -> None:
    """A candidate trained to lose held-out skill: production feedback only, with a large
    step (users accept `pass` and reject an expression), from stable's weights."""
    import random

    from app.demo import make_prompt
    from learner.trainer import Trainer
    from liverl.contracts import RewardedSample, Trajectory
    from liverl.settings import LearnerConfig

    tokenizer = AutoTokenizer.from_pretrained(stable_dir)
    trainer = Trainer(stable_dir, LearnerConfig(lr=0.05, max_steps_per_version=6))
    samples = []
    for i in range(32):
        prompt, text = tokenizer.encode(make_prompt(random.Random(i))), " pass\n" if i % 2 else " a + 1\n"
        completion = tokenizer.encode(text)
        trajectory = Trajectory(event_id=f"t{i}", tenant="dev", completion_id=f"c{i}", policy_version="v0",
                                prompt_token_ids=prompt, completion_token_ids=completion,
                                completion_logprobs=[-1.0] * len(completion))
        samples.append(RewardedSample(sample_id=f"s{i}", event_id=f"r{i}", tenant="dev", reward=float(i % 2),
                                      reward_source="feedback", reward_fn_version="test", accepted=bool(i % 2),
                                      trajectory=trajectory))
    trainer.train(samples)
    trainer.export(out)


def test_the_guard_holds_a_candidate_that_lost_skill_and_promotes_one_as_good_on_both(
        settings, stack, dev_keys, paused_learner):
    """The held-out evaluator (the real one, started here) scores each candidate before its
    canary: one trained to lose the coding skill is held with a skill verdict and never
    serves, the learner asked to rewind; one with stable's weights passes both guards."""
    from test_operations import publish_copy

    from app.stack import child_env
    from liverl.process import spawn, stop_pid

    registry = Registry(settings.policies_dir)
    skill = {"LIVERL_ROLLOUTS__HELDOUT_EVERY_S": "600", "LIVERL_ROLLOUTS__HELDOUT_TASKS": "50",
             "LIVERL_ROLLOUTS__LEVELS": "[1, 2]", "LIVERL_PORTS__EVALUATOR": str(settings.ports.gateway + 20)}
    evaluator = spawn([sys.executable, "-m", "rollouts.evaluator"], dict(child_env(settings), **skill),
                      settings.run_dir / "evaluator-test.log")
    # The slide guard stays out: it would judge the stables the tests before left (one
    # accepted half as often as v0) and roll stable back under this test (seen in CI, Nov 29).
    restart_component(settings, "controller", {
        "LIVERL_PROMOTION__CANARY_GUARD": "true", "LIVERL_PROMOTION__JUDGE_AFTER_S": "0",
        "LIVERL_PROMOTION__MIN_SAMPLES": "30", "LIVERL_PROMOTION__POLL_S": "0.5",
        "LIVERL_PROMOTION__SLIDE_MIN_SAMPLES": str(10**9), **skill})
    stop, served, threads = threading.Event(), {}, []
    stable = registry.stable()
    try:
        lose_skill(Path(stable.model_dir), settings.data_dir / "staging-unskilled")
        unskilled = registry.publish(settings.data_dir / "staging-unskilled", parent=stable.version, window=None,
                                     metrics={"gate": {"passed": True, "reason": "test"}}, sample_ids=[],
                                     actor="test")
        wait_for(lambda: registry.get(unskilled.version).state != "candidate", timeout=300, interval=1)
        # (the abort of the test before asked for a rewind to stable too: this one names the candidate)
        record = registry.get(unskilled.version)
        assert record.state == "rejected" and record.metrics["skill"]["verdict"] == "held", record.metrics
        reason = registry.history(unskilled.version)[-1]["reason"]
        assert reason.startswith("held for skill: coding: held-out pass rate") and "on the same 50 tasks" in reason
        assert registry.last_rewind().version == stable.version and unskilled.version in registry.last_rewind().reason
        assert unskilled.version not in {r.policy_version for r in read_pool(settings).replicas}

        candidate = publish_copy(settings, registry, "good")  # stable's weights: exactly as good on both
        threads = [threading.Thread(target=users, args=(settings, dev_keys["tenant_key"], "\x00never", stop, served),
                                    daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: registry.get(candidate.version).state not in ("candidate", "canary"), timeout=300, interval=1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        stop_pid(evaluator.pid)
        restart_component(settings, "controller", {})
    record = registry.get(candidate.version)
    assert record.state == "stable", (record.state, record.metrics.get("canary"), record.metrics.get("promotion_error"))
    assert record.metrics["skill"]["verdict"] == "non_inferior"
    verdict = record.metrics["canary"]
    assert verdict["verdict"] == "non_inferior" and {c["decision"] for c in verdict["comparisons"]} == {"non_inferior"}
    assert served.get(candidate.version)  # judged on what it served
    assert {r.policy_version for r in read_pool(settings).replicas} == {candidate.version}
    assert registry.get(stable.version).state == "superseded"
