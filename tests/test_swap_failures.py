"""Every swap failure reverts and is recorded; the probe checks every token and NaN fails
it; a promotion that raises leaves the promotion controller running and says why."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time

import httpx
import pytest
from helpers import wait_for

import liverl.pool
import serving.swap
from app.stack import stop_all
from liverl.pool import ROLLOUT, SERVED_MODEL_NAME, Pool, Replica, read_pool, replica_client, set_replica, write_pool
from liverl.probe import PROBE_FILE
from liverl.process import alive
from liverl.settings import PromotionConfig, Settings
from policies.registry import Registry
from promotion.controller import Controller
from serving import replicas
from serving.swap import VerificationFailed, swap_in_place, verify


def replica_answering(monkeypatch, logprobs: list[dict | None]) -> None:
    """A replica whose prompt_logprobs are `logprobs` (a fake: no real replica answers
    short or NaN logprobs on demand)."""
    def answer(request: httpx.Request) -> httpx.Response:
        body = {"choices": [{"prompt_logprobs": logprobs}]}
        return httpx.Response(200, content=json.dumps(body).encode())  # NaN as vLLM would print it

    monkeypatch.setattr(serving.swap, "replica_client", lambda url, timeout: httpx.Client(
        transport=httpx.MockTransport(answer), base_url="http://replica"))


@pytest.fixture()
def probe_dir(tmp_path):
    (tmp_path / PROBE_FILE).write_text(json.dumps({"probes": [{"token_ids": [1, 2, 3], "logprobs": [-1.0, -2.0]}]}))
    return tmp_path


def test_the_probe_checks_every_token(monkeypatch, probe_dir):
    replica_answering(monkeypatch, [None, {"2": {"logprob": -1.0}}, {"3": {"logprob": -2.0}}])
    assert verify("http://replica", probe_dir, 1e-4) == 0.0
    replica_answering(monkeypatch, [None, {"2": {"logprob": -1.0}}])  # one logprob short
    with pytest.raises(VerificationFailed, match="answered 1"):
        verify("http://replica", probe_dir, 1e-4)


def test_nan_fails_the_probe(monkeypatch, probe_dir):
    replica_answering(monkeypatch, [None, {"2": {"logprob": float("nan")}}, {"3": {"logprob": -2.0}}])
    with pytest.raises(VerificationFailed):
        verify("http://replica", probe_dir, 1e-4)


def test_a_swap_that_fails_in_any_way_reverts_and_says_why(settings, paused_learner, tmp_path):  # noqa: F811
    replica = read_pool(settings).replicas[0]
    broken = tmp_path / "no-probe"
    shutil.copytree(replica.model_dir, broken)
    (broken / PROBE_FILE).unlink()  # loads fine, cannot be verified
    report = swap_in_place(settings, replica.name, "v999", broken)
    assert not report.ok and report.reverted and "FileNotFoundError" in report.error
    back = read_pool(settings).get(replica.name)
    assert back.enabled and back.policy_version == replica.policy_version
    tenant_key = json.loads(settings.dev_keys_file.read_text())["tenant_key"]
    assert httpx.post(settings.url(settings.ports.gateway) + "/v1/completions", timeout=60,
                      headers={"Authorization": "Bearer " + tenant_key},
                      json={"prompt": "x = ", "max_tokens": 2}).status_code == 200


def test_a_replica_a_killed_swap_left_paused_and_out_of_rotation_serves_again(settings, paused_learner):
    """A swap killed after it paused the engine (taken out of rotation, vLLM paused, the
    process gone and with it the replica's lock): the running controller reloads the
    recorded weights, verifies them and puts the replica back, answering."""
    replica = read_pool(settings).replicas[0]
    set_replica(settings, replica.name, enabled=False)
    with replica_client(replica.url, timeout=10) as client:
        client.post("/pause", params={"mode": "keep", "clear_cache": "false"}).raise_for_status()
    back = wait_for(lambda: (r := read_pool(settings).get(replica.name)).enabled and r, timeout=60)
    assert back.policy_version == replica.policy_version and back.alias is None
    with replica_client(back.url, timeout=30) as client:  # paused, it would not answer
        answer = client.post("/v1/completions", json={"model": SERVED_MODEL_NAME, "prompt": "def f(",
                                                      "max_tokens": 4}).raise_for_status().json()
    assert answer["choices"][0]["text"]


def test_the_controller_survives_a_promotion_that_raises(tmp_path, starter_dir):
    settings = Settings(data_dir=tmp_path, promotion=PromotionConfig(auto_promote=True, canary_guard=False,
                                                                     poll_s=0.1))
    registry = Registry(settings.policies_dir)
    staged = tmp_path / "staged"
    shutil.copytree(starter_dir, staged)
    v0 = registry.publish(staged, parent=None, window=None, metrics={}, sample_ids=[], actor="test", state="stable")
    passed = {"gate": {"passed": True}}
    doomed = registry.publish(_copy(starter_dir, tmp_path / "a"), parent=v0.version, window=None,
                              metrics=passed, sample_ids=[], actor="test")
    shutil.rmtree(doomed.model_dir)  # retention took its weights: promote() raises
    controller = Controller(settings)
    stop = threading.Event()
    thread = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    thread.start()
    deadline = time.time() + 30
    while controller.last_error is None and time.time() < deadline:
        time.sleep(0.1)
    assert controller.last_error and doomed.version in controller.last_error
    assert "retention" in registry.get(doomed.version).metrics["promotion_error"]
    assert registry.get(doomed.version).state == "rejected"  # not tried again and again
    assert thread.is_alive()  # and it takes the next candidate
    stop.set()
    thread.join(timeout=10)


def _copy(source, target):
    shutil.copytree(source, target)
    return target


def test_down_during_a_blue_green_swap_stops_the_replica_being_started(monkeypatch, tmp_path):
    # vLLM stands in as `sleep` (its start-up is not what is tested) and never answers its
    # health check, so `liverl down` comes while the swap waits for the new replica: the
    # one process no replica record names yet.
    monkeypatch.setattr(replicas, "replica_command", lambda settings, model_dir, url: ["sleep", "120"])
    settings = Settings(data_dir=tmp_path, serving={"swap": "restart", "start_timeout_s": 60})
    old = subprocess.Popen(["sleep", "120"], start_new_session=True)
    write_pool(settings, Pool(replicas=[Replica(name="replica-0", url=replicas.replica_url(settings, 0, 0),
                                                policy_version="v0", model_dir=str(tmp_path), pid=old.pid)]))
    swap = threading.Thread(target=serving.swap.swap_by_restart, args=(settings, "replica-0", "v1", tmp_path))
    swap.start()
    wait_for(lambda: read_pool(settings).starting, timeout=10, interval=0.05)
    started = read_pool(settings).starting[0]
    assert started.policy_version == "v1" and started.pid != old.pid
    stop_all(settings, [])
    swap.join(timeout=30)
    assert not alive(started.pid) and not alive(old.pid)
    assert read_pool(settings).starting == [] and read_pool(settings).replicas == []


def test_the_new_engine_of_a_blue_green_swap_a_killed_process_left_is_stopped(tmp_path):
    """A swap by restart killed before its new engine was verified leaves that engine in
    `pool.starting`, serving nobody and holding memory and a core: once nobody holds the
    replica's lock it is stopped and forgotten. (The engine is a stand-in process: what is
    tested is who stops it and when.)"""
    settings = Settings(data_dir=tmp_path)
    engine = subprocess.Popen(["sleep", "600"], start_new_session=True)
    write_pool(settings, Pool(
        replicas=[Replica(name="r0", url="http://127.0.0.1:1", policy_version="v3", model_dir=str(tmp_path))],
        starting=[Replica(name="r0", url="http://127.0.0.1:2", policy_version="v4", model_dir=str(tmp_path),
                          pid=engine.pid)]))
    with liverl.pool.replica_lock(settings, "r0"):  # the swap still running, in another process
        assert serving.swap.stop_abandoned_engines(settings) == []
    assert engine.poll() is None and read_pool(settings).starting
    assert [r.pid for r in serving.swap.stop_abandoned_engines(settings)] == [engine.pid]
    assert engine.wait(timeout=10) is not None and read_pool(settings).starting == []
    assert [r.name for r in read_pool(settings).replicas] == ["r0"]  # the old engine serves on


def test_a_blue_green_swap_keeps_what_the_replica_is_for(monkeypatch, tmp_path):
    # The new engine's health, probe and the old one's drain are faked (a vLLM start-up is
    # not what is tested): a replica lent to rollouts must come back from the swap lent,
    # not as a production replica serving the learner's unchecked head.
    monkeypatch.setattr(replicas, "replica_command", lambda settings, model_dir, url: ["sleep", "120"])
    monkeypatch.setattr(serving.swap, "wait_replica", lambda settings, replica, process: None)
    monkeypatch.setattr(serving.swap, "verify", lambda url, model_dir, tolerance: 0.0)
    monkeypatch.setattr(serving.swap, "drain_in_flight", lambda url, timeout_s: 0.0)
    settings = Settings(data_dir=tmp_path, serving={"swap": "restart"})
    old = subprocess.Popen(["sleep", "120"], start_new_session=True)
    write_pool(settings, Pool(replicas=[Replica(name="replica-0", url=replicas.replica_url(settings, 0, 0),
                                                policy_version="v0", model_dir=str(tmp_path), pid=old.pid,
                                                alias=ROLLOUT)]))
    try:
        assert serving.swap.swap_by_restart(settings, "replica-0", "v1", tmp_path).ok
        swapped = read_pool(settings).get("replica-0")
        assert swapped.alias == ROLLOUT and swapped.policy_version == "v1" and swapped.pid != old.pid
        assert not alive(old.pid) and read_pool(settings).starting == []
    finally:
        stop_all(settings, [])
