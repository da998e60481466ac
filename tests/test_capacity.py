"""The capacity scheduler: when an idle replica is lent to rollouts, when it comes back, and
(on the shared stack) that production takes it back from running rollouts without a
failed request."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from helpers import serving_load, wait_for
from typer.testing import CliRunner

import liverl.pool
import serving.swap
from app.cli import app
from app.demo import demo_settings
from app.stack import status as stack_status
from liverl.audit import AuditLog
from liverl.contracts import CapacityEvent
from liverl.kafka import make_producer
from liverl.lending import read_events, read_pause, set_pause
from liverl.load import GatewayLoad
from liverl.pool import ROLLOUT, Pool, Replica, read_pool, write_pool
from liverl.settings import CapacityConfig, PromotionConfig, RolloutsConfig, Settings
from rollouts.worker import RolloutWorker
from serving.capacity import Decision, Hysteresis, Scheduler, create_app
from sync.replica import ReplicaSync


def pool(lent: int = 0, replicas: int = 2, canary: bool = False) -> Pool:
    return Pool(replicas=[Replica(name=f"r{i}", url="http://x", policy_version="v3", model_dir="/m",
                                  alias=ROLLOUT if i < lent else None) for i in range(replicas)],
                aliases={"stable": "v3", **({"canary": "v4"} if canary else {})})


def load(in_flight: dict[str, int] | None = None, waiting: int = 0, requests_per_s: float = 0.0) -> GatewayLoad:
    return GatewayLoad(in_flight=in_flight or {}, waiting=waiting, requests_per_s=requests_per_s, window_s=5.0)


CONFIG = CapacityConfig(lend_below=0.5, lend_after_s=10, take_back_above=1.0, min_production_replicas=1)


def test_a_replica_is_lent_only_after_the_load_stayed_low_for_a_while():
    rules = Hysteresis(CONFIG)
    assert rules.decide(0, load(), pool(), False) is None
    assert rules.decide(5, load(), pool(), False) is None
    assert rules.decide(6, load({"r1": 3}), pool(), False) is None  # a busy moment restarts the wait
    assert rules.decide(15, load(), pool(), False) is None
    assert rules.decide(24, load(), pool(), False) is None
    lend = rules.decide(25.5, load({"r1": 1}), pool(), False)
    assert lend.action == "lend" and lend.replica == "r0"  # the quieter one
    assert rules.decide(26, load(), pool(replicas=3), False) is None  # the next lend waits a quiet period


def test_production_keeps_its_minimum_and_a_canary_blocks_lending():
    rules = Hysteresis(CONFIG.model_copy(update={"min_production_replicas": 2}))
    assert [rules.decide(t, load(), pool(), False) for t in (0, 20)] == [None, None]
    rules = Hysteresis(CONFIG)
    assert [rules.decide(t, load(), pool(canary=True), False) for t in (0, 20)] == [None, None]
    assert [rules.decide(t, load(), pool(), True) for t in (0, 20)] == [None, None]
    # One lent of two: the last production replica is never lent.
    assert [rules.decide(t, load(), pool(lent=1), False) for t in (0, 20, 40)] == [None, None, None]


def test_take_back_at_once_above_the_upper_threshold_and_not_between_the_two():
    rules = Hysteresis(CONFIG)
    lent = pool(lent=1)
    assert rules.decide(0, load({"r1": 1}), lent, False) is None  # 1.0: between the two, nothing changes
    back = rules.decide(0.1, load({"r1": 1}, waiting=1), lent, False)
    assert back.action == "take_back" and back.replica == "r0" and back.load == 2.0
    # Production wins over rollouts for a canary too, at no load at all.
    assert rules.decide(0.2, load(), lent, True).action == "take_back"
    # A replica whose take-back failed a moment ago waits; another lent one is taken instead.
    two_lent = pool(lent=2, replicas=3)
    assert rules.decide(0.3, load({"r2": 3}), two_lent, False, frozenset({"r0"})).replica == "r1"
    assert rules.decide(0.4, load({"r2": 3}), two_lent, False, frozenset({"r0", "r1"})) is None
    # Once its pause is over, a failed take-back is finished even if the load fell meanwhile.
    stuck = Pool(replicas=[r.model_copy(update={"enabled": r.name != "r0"}) for r in lent.replicas],
                 aliases=lent.aliases)
    assert rules.decide(0.5, load(), stuck, False).action == "take_back"
    assert rules.decide(0.6, load(), stuck, False, frozenset({"r0"})) is None


def test_a_take_back_whose_swap_failed_is_retried_after_a_pause_not_at_every_poll(monkeypatch, tmp_path):
    """A swap back to stable that fails (injected: a real replica cannot be made to fail on
    demand here) leaves the replica out of production; the next polls do not hammer it."""
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.config, scheduler.rules = CONFIG.model_copy(update={"retry_s": 60}), Hysteresis(CONFIG)
    scheduler.settings = SimpleNamespace(run_dir=tmp_path, promotion=PromotionConfig())
    scheduler.retry_at, scheduler.calm_at = {}, None
    monkeypatch.setattr("serving.capacity.read_pool", lambda settings: pool(lent=1))
    monkeypatch.setattr(Scheduler, "gateway_load", lambda self: load({"r1": 1}, waiting=2, requests_per_s=1.0))
    monkeypatch.setattr(Scheduler, "canary_wanted", lambda self, p: False)
    refreshed = []
    monkeypatch.setattr(Scheduler, "refresh", lambda self: refreshed.append(True))
    tries = []

    def failing_take_back(self, decision, asked_at):
        tries.append(decision.replica)
        return CapacityEvent(action="take_back", replica=decision.replica, policy_version="v3",
                             load=decision.load, why=decision.why, seconds=0.1, error="swap failed")
    monkeypatch.setattr(Scheduler, "take_back", failing_take_back)
    assert scheduler.step().error == "swap failed"
    assert [scheduler.step() for _ in range(5)] == [None] * 5 and tries == ["r0"]
    scheduler.retry_at["r0"] = 0.0  # the pause is over
    assert scheduler.step().error == "swap failed" and tries == ["r0", "r0"]


def test_a_candidate_takes_a_replica_back_only_when_there_is_traffic_to_judge_it(monkeypatch, tmp_path):
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.config, scheduler.rules, scheduler.retry_at, scheduler.calm_at = CONFIG, Hysteresis(CONFIG), {}, None
    monkeypatch.setattr("serving.capacity.read_pool", lambda settings: pool(lent=1))
    monkeypatch.setattr(Scheduler, "canary_wanted", lambda self, p: True)
    monkeypatch.setattr(Scheduler, "refresh", lambda self: None)
    monkeypatch.setattr(Scheduler, "take_back", lambda self, decision, asked_at: CapacityEvent(
        action="take_back", replica=decision.replica, policy_version="v3", load=decision.load, why=decision.why,
        seconds=0.1))
    scheduler.settings = SimpleNamespace(run_dir=tmp_path, promotion=PromotionConfig())
    monkeypatch.setattr(Scheduler, "gateway_load", lambda self: load())  # a trough: nobody to judge it
    assert scheduler.step() is None
    monkeypatch.setattr(Scheduler, "gateway_load", lambda self: load(requests_per_s=0.5))
    assert scheduler.step().why == "a canary needs the replica"
    # Traffic too thin to judge a canary on (one user at night) leaves the replica lent too.
    scheduler.settings = SimpleNamespace(run_dir=tmp_path, promotion=PromotionConfig(quiet_requests_per_s=15.0))
    monkeypatch.setattr(Scheduler, "gateway_load", lambda self: load(requests_per_s=12.0))
    assert scheduler.step() is None
    monkeypatch.setattr(Scheduler, "gateway_load", lambda self: load(requests_per_s=20.0))
    assert scheduler.step().why == "a canary needs the replica"


def test_a_take_back_is_timed_from_the_last_calm_reading_so_a_refresh_in_the_way_counts(monkeypatch, tmp_path):
    # The loop reads no load while a refresh swaps the lent replica: a peak that arrives
    # meanwhile waits for it, and the take-back's seconds must say so.
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.config, scheduler.rules, scheduler.retry_at, scheduler.calm_at = CONFIG, Hysteresis(CONFIG), {}, None
    scheduler.settings = SimpleNamespace(run_dir=tmp_path, promotion=PromotionConfig())
    monkeypatch.setattr("serving.capacity.read_pool", lambda settings: pool(lent=1))
    monkeypatch.setattr(Scheduler, "canary_wanted", lambda self, p: False)
    monkeypatch.setattr(Scheduler, "refresh", lambda self: time.sleep(0.3))  # a swap to the newest version
    monkeypatch.setattr(Scheduler, "take_back", lambda self, decision, asked_at: CapacityEvent(
        action="take_back", replica=decision.replica, policy_version="v3", load=decision.load, why=decision.why,
        seconds=time.time() - asked_at))
    monkeypatch.setattr(Scheduler, "gateway_load", lambda self: load())
    assert scheduler.step() is None  # quiet: it refreshed, 0.3 s without a reading
    monkeypatch.setattr(Scheduler, "gateway_load", lambda self: load({"r1": 3}))
    assert scheduler.step().seconds >= 0.3
    # Between the thresholds nothing is taken back, and no refresh holds the loop either.
    refreshed = []
    monkeypatch.setattr(Scheduler, "refresh", lambda self: refreshed.append(True))
    monkeypatch.setattr(Scheduler, "gateway_load", lambda self: load({"r1": 1}))
    assert scheduler.step() is None and refreshed == []


def test_a_pinned_stable_wants_no_canary_so_nothing_is_taken_back_for_one():
    # The controller starts no canary while stable is pinned: taking the replica back for
    # one would lend and take back every few seconds, halving production each time.
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.settings = SimpleNamespace(promotion=PromotionConfig(auto_promote=True, canary_guard=True))
    candidate = SimpleNamespace(seq=4, metrics={"gate": {"passed": True}})
    pin = None
    scheduler.registry = SimpleNamespace(stable=lambda: SimpleNamespace(seq=3), pinned=lambda: pin,
                                         in_state=lambda state: [candidate] if state == "candidate" else [])
    assert scheduler.canary_wanted(pool(lent=1))
    pin = SimpleNamespace(version="v3", actor="on-call", reason="incident")
    assert not scheduler.canary_wanted(pool(lent=1))


def test_a_stable_that_cannot_be_staged_is_tried_again_after_a_pause_not_at_every_poll(monkeypatch):
    """Staging that fails (injected: here the delta store never had the starter) was tried
    at every poll, thousands of times in a ten-minute run; now once per `retry_s`."""
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.config, scheduler.staging, scheduler.keep_retry_at = CONFIG.model_copy(update={"retry_s": 60}), \
        threading.Lock(), {}
    scheduler.settings = SimpleNamespace(sync=SimpleNamespace(transport="delta"))
    scheduler.registry = SimpleNamespace(stable=lambda: SimpleNamespace(version="v0"))
    monkeypatch.setattr("serving.capacity.read_pool", lambda settings: pool(lent=1))
    tries = []

    def keep(version):
        tries.append(version)
        raise KeyError(f"{version} cannot be rebuilt from the store")
    monkeypatch.setattr(ReplicaSync, "of", lambda settings, name: SimpleNamespace(
        state=lambda: SimpleNamespace(kept=None), keep=keep))
    for _ in range(5):
        scheduler.keep_stable("r0")
    assert tries == ["v0"]
    scheduler.keep_retry_at[("r0", "v0")] = 0.0  # the pause is over
    scheduler.keep_stable("r0")
    assert tries == ["v0", "v0"]


def test_a_look_that_raises_is_logged_and_the_scheduler_looks_again(monkeypatch):
    # A dead scheduler would leave lent replicas lent through the next peak.
    scheduler, stop, looks = Scheduler.__new__(Scheduler), threading.Event(), []
    scheduler.config = CONFIG.model_copy(update={"poll_s": 0.01})

    def step(self):
        looks.append(True)
        if len(looks) == 3:
            stop.set()
        raise KeyError("no replica named 'r9'")
    monkeypatch.setattr(Scheduler, "step", step)
    scheduler.run(stop)
    assert len(looks) == 3


def test_a_pause_takes_every_lent_replica_back_and_lends_none_until_resumed():
    rules, why = Hysteresis(CONFIG), "lending paused by on-call: a launch at noon"
    back = rules.decide(0, load(), pool(lent=1), False, paused=why)  # no load at all
    assert back.action == "take_back" and back.replica == "r0" and back.why == why
    for now in (1, 100, 1000):  # quiet for ever: nothing lent
        assert rules.decide(now, load(), pool(), False, paused=why) is None
    assert rules.decide(1001, load(), pool(), False) is None  # resumed: a quiet period of its own first
    assert rules.decide(1001 + CONFIG.lend_after_s, load(), pool(), False).action == "lend"


def test_on_call_pauses_lending_through_the_api_and_a_restart_keeps_it(settings, paused_learner, dev_keys):
    fast = settings.capacity.model_copy(update={"enabled": True, "lend_after_s": 1.0, "poll_s": 0.05})
    configured = settings.model_copy(update={"capacity": fast})
    scheduler, stop = Scheduler(configured), threading.Event()
    loop = threading.Thread(target=scheduler.run, args=(stop,))
    loop.start()
    admin = {"Authorization": f"Bearer {dev_keys['admin_key']}"}
    try:
        with TestClient(create_app(scheduler)) as api:
            wait_for(lambda: read_pool(settings).lent, timeout=60)
            assert api.post("/admin/pause", json={"reason": " "}, headers=admin).status_code == 422
            tenant = {"Authorization": f"Bearer {dev_keys['tenant_key']}"}
            assert api.post("/admin/pause", json={"reason": "x"}, headers=tenant).status_code == 403
            paused = api.post("/admin/pause", json={"reason": "a launch at noon"}, headers=admin)
            assert paused.json() == {"paused": True, "lent": []}  # it answers once every lent replica is back
            assert all(r.enabled and r.alias is None for r in read_pool(settings).replicas)
            # The take-back is recorded just after the pool shows the replica back (its swap's
            # report goes with it), so a moment after the answer.
            wait_for(lambda: read_events(settings)[-1].action == "take_back", timeout=30)
            back = read_events(settings)[-1]
            assert back.why.endswith("a launch at noon")
            time.sleep(3 * fast.lend_after_s)  # quiet, and nothing lent
            assert not read_pool(settings).lent and read_events(settings)[-1] == back
            assert api.get("/health").json()["paused"]["reason"] == "a launch at noon"
            assert stack_status(settings)["lending"]["paused"]["reason"] == "a launch at noon"  # liverl status
            # A restarted scheduler is paused too (with no wait for quiet, unpaused it would lend at once).
            eager = configured.model_copy(update={"capacity": fast.model_copy(update={"lend_after_s": 0.0})})
            assert Scheduler(eager).step() is None
            assert [e.reason for e in AuditLog(settings.audit_file).entries(1, action="capacity.pause")] == [
                "a launch at noon"]  # audited: the newest pause in the shared stack's log
            resumed = api.post("/admin/resume", json={"reason": "launched"}, headers=admin)
            assert resumed.json() == {"paused": False, "lent": []}
            wait_for(lambda: read_pool(settings).lent, timeout=60)
            # Back as the other tests expect the pool: nothing lent, lending on.
            assert api.post("/admin/pause", json={"reason": "end of test"}, headers=admin).json()["lent"] == []
    finally:
        stop.set()
        loop.join(timeout=60)
        set_pause(settings, None)


def test_the_cli_pauses_lending_itself_when_the_scheduler_is_down(tmp_path):
    runner = CliRunner(env={"LIVERL_ADMIN_KEY": "on-call's key"})
    paused = runner.invoke(app, ["capacity", "pause", "--reason", "an incident", "--data-dir", str(tmp_path)])
    assert paused.exit_code == 0 and "lending paused for when the scheduler runs" in paused.output
    settings = Settings(data_dir=tmp_path)
    assert read_pause(settings).reason == "an incident" and read_pause(settings).actor.startswith("cli:")
    status = runner.invoke(app, ["capacity", "status", "--data-dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert status.exit_code == 0 and "lending paused by cli:" in status.output and "an incident" in status.output
    resumed = runner.invoke(app, ["capacity", "resume", "--reason", "over", "--data-dir", str(tmp_path)])
    assert resumed.exit_code == 0 and read_pause(settings) is None
    assert [e.action for e in AuditLog(settings.audit_file).entries()] == ["capacity.pause", "capacity.resume"]


def test_hysteresis_needs_the_upper_threshold_above_the_lower():
    with pytest.raises(ValueError, match="TAKE_BACK_ABOVE"):
        CapacityConfig(lend_below=2.0, take_back_above=1.0)


def test_an_idle_replica_is_lent_to_rollouts_and_a_burst_takes_it_back_without_a_failed_request(
        settings, paused_learner, dev_keys):
    fast = settings.capacity.model_copy(update={"enabled": True, "lend_after_s": 1.0, "poll_s": 0.05})
    rollouts = RolloutsConfig(group_size=4, levels=[1], max_tokens=24, scoring_threads=2)
    configured = settings.model_copy(update={"capacity": fast, "rollouts": rollouts})
    scheduler = Scheduler(configured)
    recorded_before = len(read_events(settings))
    lend = wait_for(scheduler.step, timeout=30, interval=0.05)
    assert lend.action == "lend" and read_pool(settings).get(lend.replica).alias == ROLLOUT
    assert [r.name for r in read_pool(settings).general] != [lend.replica]
    lent_sync = ReplicaSync.of(settings, lend.replica)
    assert lent_sync.state().pending is None

    # Rollouts run on the lent replica while production arrives.
    worker = RolloutWorker(configured, seed=1)
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()

    async def rollouts() -> None:
        producer = make_producer(settings)
        await producer.start()
        try:
            await worker.run(producer, stop)
        finally:
            await producer.stop()
    thread = threading.Thread(target=loop.run_until_complete, args=(rollouts(),))
    thread.start()
    try:
        wait_for(lambda: worker.counts["groups"] >= 1, timeout=120)
        with serving_load(settings, dev_keys["tenant_key"], clients=4) as statuses:
            back = wait_for(scheduler.step, timeout=30, interval=0.05)
            assert back.action == "take_back" and back.replica == lend.replica and back.error is None
            replica = read_pool(settings).get(lend.replica)
            assert replica.alias is None and replica.enabled and lent_sync.state().kept is None
            # It kept stable's weights staged (or loads them whole from the registry): nothing to decode.
            assert back.steps.get("decode_s", 0.0) == 0.0
            # Production reaches the replica it got back.
            wait_for(lambda: scheduler.gateway_load().in_flight.get(lend.replica, 0) > 0, timeout=30, interval=0.02)
            assert scheduler.gateway_load().tokens_per_s > 0  # production's answers, in the load signal
        assert set(statuses) == {200}
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=60)
    assert back.seconds < 5 and back.load > fast.take_back_above and back.bound_s == fast.take_back_bound_s
    # This test's lend and take-back, recorded (counted, not dated: a CI machine's clock once
    # jumped 217 s while its VM was paused, Dec 1).
    assert [e.event_id for e in read_events(settings)[recorded_before:]] == [lend.event_id, back.event_id]
    assert "abort_s" in back.steps  # where the take-back's time went (and the swap's, if it swapped)


def test_a_replica_a_killed_lend_left_out_of_rotation_goes_back_into_production(settings, paused_learner,
                                                                               monkeypatch):
    """The scheduler killed while a lend drains its replica leaves it out of rotation and not
    lent: the running controller finds it with nobody working on it, reloads and verifies
    its weights and puts it back. (The kill is an exception at that line: leaving the lend,
    it releases the replica's lock as the process's death does.)"""
    class Killed(BaseException):
        pass

    def killed_while_draining(self, url):
        raise Killed
    monkeypatch.setattr(Scheduler, "drain", killed_while_draining)
    fast = settings.capacity.model_copy(update={"enabled": True, "lend_after_s": 1.0, "poll_s": 0.05})
    scheduler = Scheduler(settings.model_copy(update={"capacity": fast}))
    with pytest.raises(Killed):
        wait_for(scheduler.step, timeout=30, interval=0.05)
    left, = [r for r in read_pool(settings).replicas if not r.enabled]
    assert left.alias is None  # out of rotation, and not the scheduler's to take back
    back = wait_for(lambda: (r := read_pool(settings).get(left.name)).enabled and r, timeout=60)
    assert back.alias is None and back.policy_version == read_pool(settings).aliases["stable"]


def test_a_replica_out_of_rotation_is_left_to_whoever_holds_its_lock(monkeypatch, tmp_path):
    # vLLM's side is faked: what is tested is that a swap or lend under way is never raced.
    settings = Settings(data_dir=tmp_path)
    write_pool(settings, Pool(replicas=[Replica(name="r0", url="http://127.0.0.1:1", policy_version="v3",
                                                model_dir=str(tmp_path), enabled=False)],
                              aliases={"stable": "v3"}))
    reloaded = []

    def revert(settings, replica, enable=True):  # vLLM's reload and probe of the recorded weights
        reloaded.append(replica.name)
        liverl.pool.set_replica(settings, replica.name, enabled=enable)
        return True
    monkeypatch.setattr(serving.swap, "revert", revert)
    with liverl.pool.replica_lock(settings, "r0"):  # a swap or a lend under way, in another process
        assert serving.swap.restore_abandoned(settings) == {}
    assert reloaded == [] and not read_pool(settings).get("r0").enabled
    assert serving.swap.restore_abandoned(settings) == {"r0": True}
    assert reloaded == ["r0"] and read_pool(settings).get("r0").enabled


@pytest.mark.parametrize("swap_back_fails", [False, True], ids=["swapped-back", "swap-back-failed"])
def test_a_replica_on_its_way_back_is_never_open_to_rollouts(monkeypatch, tmp_path, swap_back_fails):
    # vLLM's side of the swap is faked (loading, the probe, the drain; a real swap under load
    # is the stack test's): what is tested is the pool at every write, since the worker starts
    # groups on any enabled lent replica, and those would run beside production, unaborted.
    settings = Settings(data_dir=tmp_path, sync={"transport": "full"})
    write_pool(settings, Pool(replicas=[Replica(name="r0", url="http://127.0.0.1:1", policy_version="v4",
                                                model_dir=str(tmp_path), alias=ROLLOUT)],
                              aliases={"stable": "v3"}))
    probes = []
    monkeypatch.setattr(serving.swap, "load_in_place", lambda url, model_dir: {})
    monkeypatch.setattr(serving.swap, "drain_in_flight", lambda url, timeout_s: 0.0)

    def verify(url, model_dir, tolerance):
        probes.append(model_dir)
        if swap_back_fails and len(probes) == 1:
            raise serving.swap.VerificationFailed("stable's probe failed on the replica")
        return 0.0
    monkeypatch.setattr(serving.swap, "verify", verify)
    written = []
    real_write = liverl.pool.write_pool
    monkeypatch.setattr(liverl.pool, "write_pool", lambda s, p: (written.append(p.get("r0").model_copy()),
                                                                 real_write(s, p)))
    scheduler = Scheduler(settings)
    stable = SimpleNamespace(version="v3", model_dir=str(tmp_path))
    scheduler.registry = SimpleNamespace(stable=lambda: stable, get=lambda version: stable)
    monkeypatch.setattr(Scheduler, "event", lambda self, action, decision, version, seconds, error, *a, **k: error)
    error = scheduler.take_back(Decision("take_back", "r0", 2.0, "a peak"), time.time())
    assert not [r for r in written if r.enabled and r.alias == ROLLOUT]
    back = read_pool(settings).get("r0")
    if swap_back_fails:  # out of both: the next look takes it back again
        assert error and not back.enabled and back.alias == ROLLOUT and back.policy_version == "v4"
    else:
        assert error is None and back.enabled and back.alias is None and back.policy_version == "v3"


def refreshing(monkeypatch, config: CapacityConfig) -> tuple[Scheduler, list[str]]:
    """A scheduler with one lent replica on v3 and the learner at v5, and the steps its
    refreshes take. vLLM's side is faked (its drain, abort and swap are the stack test's):
    what is tested is the order, since a request still running when the weights change
    would finish its group on the new version under the old version's label."""
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.config, scheduler.refreshed, scheduler.staged_ahead = config, {}, {}
    scheduler.settings = SimpleNamespace(serving=SimpleNamespace(swap_drain_s=5.0),
                                         sync=SimpleNamespace(transport="full"))
    scheduler.keeping = SimpleNamespace(done=lambda: False)  # stable is being kept staged already
    monkeypatch.setattr(Scheduler, "rollout_version", lambda self: SimpleNamespace(version="v5"))
    monkeypatch.setattr("serving.capacity.read_pool", lambda settings: pool(lent=1))
    steps: list[str] = []
    monkeypatch.setattr(Scheduler, "stage_ahead", lambda self, name, version: steps.append(f"stage {version.version}"))
    monkeypatch.setattr("serving.capacity.set_replica", lambda settings, name, **changes: steps.append(
        "enable" if changes["enabled"] else "disable"))
    monkeypatch.setattr(Scheduler, "drain", lambda self, url: steps.append("drain") or True)
    monkeypatch.setattr("serving.capacity.abort_rollouts", lambda url: steps.append("abort"))
    monkeypatch.setattr(Scheduler, "move", lambda self, name, version, enable=True: steps.append(
        f"swap to {version.version}"))
    return scheduler, steps


def test_a_refresh_changes_the_weights_only_once_no_rollout_request_runs(monkeypatch):
    scheduler, steps = refreshing(monkeypatch, CONFIG.model_copy(update={"refresh_s": 0.0}))
    assert scheduler.refresh() is None
    assert steps == ["stage v5", "disable", "drain", "abort", "swap to v5", "enable"]


def test_a_refresh_between_groups_waits_for_the_lent_replicas_groups_and_cuts_none(monkeypatch):
    # capacity.refresh = between_groups: the worker starts no group on a replica behind the
    # learner (its test is below), and the scheduler stages the newest version while the last
    # groups run, then swaps once none does: no drain to a deadline, no abort.
    scheduler, steps = refreshing(monkeypatch, CONFIG.model_copy(update={"refresh": "between_groups",
                                                                         "refresh_s": 3600.0}))
    running = iter([2, 1, 0])  # the replica's requests at each look: its last groups end
    monkeypatch.setattr("serving.capacity.in_flight", lambda url: next(running))
    assert scheduler.refresh() is None and scheduler.refresh() is None
    assert steps == ["stage v5"]  # staged once, while two groups and then one still ran
    assert scheduler.refresh() is None
    assert steps == ["stage v5", "disable", "swap to v5", "enable"]  # refresh_s (an hour) is not waited for


def test_the_worker_starts_no_group_on_a_replica_behind_the_learner():
    lent = Replica(name="r0", url="http://x", policy_version="v4", model_dir="/m", alias=ROLLOUT)
    worker = RolloutWorker(Settings(capacity=CapacityConfig(refresh="between_groups")),
                           environment=SimpleNamespace(tasks=lambda split, rng: iter(())))
    newest = SimpleNamespace(version="v5")
    worker.registry = SimpleNamespace(rollout_version=lambda: newest)
    started = []

    async def run_group(producer, client, replica):  # a group that ends at once
        started.append(replica.policy_version)

    async def run_for(seconds: float) -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        await worker.run(None, stop)
    worker.run_group = run_group
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("rollouts.worker.lent_replicas", lambda settings: [lent])
        asyncio.run(run_for(0.5))
        assert started == []  # the learner has v5: the replica waits for the scheduler to move it
        newest.version = "v4"  # moved (or the learner not ahead)
        asyncio.run(run_for(0.5))
    assert len(started) >= worker.config.groups_in_flight and set(started) == {"v4"}


def test_a_refresh_gives_way_at_once_when_production_returns_during_its_drain(monkeypatch, tmp_path):
    # A refresh waits up to swap_drain_s (5 s) for running groups: a peak that arrived
    # meanwhile waited for the drain and the swap, past the take-back bound. Now the drain
    # reads production's load as it waits, and the replica goes straight back, not swapped.
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.config, scheduler.rules, scheduler.retry_at, scheduler.calm_at = \
        CONFIG.model_copy(update={"refresh_s": 0.0}), Hysteresis(CONFIG), {}, None
    scheduler.refreshed = {}
    scheduler.settings = SimpleNamespace(run_dir=tmp_path, promotion=PromotionConfig(),
                                         serving=SimpleNamespace(swap_drain_s=5.0),
                                         sync=SimpleNamespace(transport="full"))
    scheduler.keeping = SimpleNamespace(done=lambda: False)
    monkeypatch.setattr(Scheduler, "rollout_version", lambda self: SimpleNamespace(version="v5"))
    monkeypatch.setattr(Scheduler, "canary_wanted", lambda self, p: False)
    monkeypatch.setattr("serving.capacity.read_pool", lambda settings: pool(lent=1))
    monkeypatch.setattr("serving.capacity.set_replica", lambda settings, name, **changes: None)
    monkeypatch.setattr("serving.capacity.in_flight", lambda url: 2)  # a group that runs long
    monkeypatch.setattr("serving.capacity.abort_rollouts", lambda url: 2)
    swaps = []
    monkeypatch.setattr(Scheduler, "move", lambda self, name, version, enable=True: swaps.append(version.version))
    readings = iter([load(), load(), load({"r1": 3})])  # calm, calm (the drain's first look), a peak
    monkeypatch.setattr(Scheduler, "gateway_load", lambda self: next(readings, load({"r1": 3})))
    monkeypatch.setattr(Scheduler, "take_back", lambda self, decision, asked_at: CapacityEvent(
        action="take_back", replica=decision.replica, policy_version="v3", load=decision.load, why=decision.why,
        seconds=time.time() - asked_at))
    started = time.time()
    back = scheduler.step()
    assert back is not None and back.action == "take_back" and back.why == "production returned during a refresh"
    assert time.time() - started < 1.0 and swaps == []  # no 5 s drain, no swap to v5 first


def test_a_take_back_records_its_bound_and_one_over_it_is_counted(monkeypatch, tmp_path):
    from serving.capacity import OVER_BOUND
    settings = Settings(data_dir=tmp_path, capacity={"take_back_bound_s": 2.0})
    settings.run_dir.mkdir(parents=True)
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.settings, scheduler.config = settings, settings.capacity
    monkeypatch.setattr("serving.capacity.read_pool", lambda s: pool(lent=1))
    monkeypatch.setattr("serving.capacity.produce_sync", lambda *a: None)
    before = OVER_BOUND._value.get()
    decision = Decision("take_back", "r0", 3.0, "a peak", tokens_per_s=120.0)
    fast = scheduler.event("take_back", decision, "v3", 0.8, None)
    slow = scheduler.event("take_back", decision, "v3", 2.5, None)
    lend = scheduler.event("lend", Decision("lend", "r0", 0.0, "quiet"), "v5", 0.7, None)
    assert (fast.bound_s, slow.bound_s, lend.bound_s) == (2.0, 2.0, None)
    assert fast.tokens_per_s == 120.0
    assert OVER_BOUND._value.get() == before + 1
    assert [e.seconds for e in read_events(settings)] == [0.8, 2.5, 0.7]


def test_production_tokens_per_second_can_hold_a_lend_back():
    # Few requests but long generations are still a busy replica.
    rules = Hysteresis(CONFIG.model_copy(update={"lend_after_s": 0.0, "lend_below_tokens_per_s": 50.0}))
    busy_tokens = load({"r1": 0}, requests_per_s=0.2).model_copy(update={"tokens_per_s": 400.0})
    assert rules.decide(0.0, busy_tokens, pool(), False) is None
    quiet = load(requests_per_s=0.2).model_copy(update={"tokens_per_s": 20.0})
    assert rules.decide(1.0, quiet, pool(), False).action == "lend"


def fake_swaps(monkeypatch, settings, during=None, failing=()):
    """vLLM's side of a swap faked: the pool records the new version (what a verified swap
    writes); `during(version)` runs while the first swap is under way; a swap to a version
    in `failing` fails verification, and the replica serves on as it did."""
    swaps = []

    def replace(settings_, name, version, model_dir, enable=True):
        swaps.append((name, version))
        if during is not None and len(swaps) == 1:
            during(version)
        if version in failing:
            return serving.swap.SwapReport(replica=name, version=version, ok=False, mode="inplace",
                                           error="probe mismatch", reverted=True)
        liverl.pool.set_replica(settings, name, policy_version=version, enabled=enable)
        return serving.swap.SwapReport(replica=name, version=version, ok=True, mode="inplace")
    monkeypatch.setattr("serving.capacity.replace_replica", replace)
    monkeypatch.setattr("serving.swap.replace_replica", replace)
    monkeypatch.setattr("promotion.promoter.Promoter.weights", lambda self, version: Path("/m"))
    return swaps


def two_replicas(tmp_path, lent: bool) -> Settings:
    settings = Settings(data_dir=tmp_path, sync={"transport": "full"})
    settings.run_dir.mkdir(parents=True)
    write_pool(settings, Pool(replicas=[
        Replica(name="r0", url="http://127.0.0.1:1", policy_version="v3", model_dir="/m"),
        Replica(name="r1", url="http://127.0.0.1:1", policy_version="v5" if lent else "v3", model_dir="/m",
                alias=ROLLOUT if lent else None)], aliases={"stable": "v3"}))
    return settings


def versions(settings: Settings) -> dict:
    pool = read_pool(settings)
    return {r.name: (r.policy_version, r.alias, r.enabled) for r in pool.replicas} | {"stable": pool.aliases["stable"]}


def test_a_replica_taken_back_while_a_promotion_finishes_serves_the_new_stable(monkeypatch, tmp_path):
    # The promotion's roll-out skipped the lent replica; the take-back had read the old
    # stable. Before, the replica came back on v3 while every other served v4, for good.
    settings = two_replicas(tmp_path, lent=True)

    def promotion_finishes(version):  # r0 moved and the alias with it, while r1 swaps back to v3
        liverl.pool.set_replica(settings, "r0", policy_version="v4")
        liverl.pool.set_aliases(settings, stable="v4")
    swaps = fake_swaps(monkeypatch, settings, during=promotion_finishes)
    monkeypatch.setattr("serving.capacity.abort_rollouts", lambda url: 0)
    scheduler = Scheduler(settings)
    scheduler.registry = SimpleNamespace(get=lambda v: SimpleNamespace(version=v, model_dir="/m"),
                                         stable=lambda: SimpleNamespace(version="v3", model_dir="/m"))
    monkeypatch.setattr(Scheduler, "event", lambda self, action, decision, version, seconds, error, *a, **k: error)
    assert scheduler.take_back(Decision("take_back", "r1", 2.0, "a peak"), time.time()) is None
    assert swaps == [("r1", "v3"), ("r1", "v4")]
    assert versions(settings) == {"r0": ("v4", None, True), "r1": ("v4", None, True), "stable": "v4"}


def test_a_promotion_catches_a_replica_that_came_back_from_rollouts_during_its_roll_out(monkeypatch, tmp_path):
    from promotion.promoter import Promoter
    settings = two_replicas(tmp_path, lent=True)

    def take_back_lands(version):  # the scheduler returns r1 on the stable it read, v3
        liverl.pool.set_replica(settings, "r1", policy_version="v3", alias=None, enabled=True)
    swaps = fake_swaps(monkeypatch, settings, during=take_back_lands)
    Promoter(settings, registry=None).serve_everywhere("v4")
    assert swaps == [("r0", "v4"), ("r1", "v4")]
    assert versions(settings) == {"r0": ("v4", None, True), "r1": ("v4", None, True), "stable": "v4"}


def test_a_lend_looks_again_once_it_holds_the_replica(monkeypatch, tmp_path):
    # The controller made the replica a canary between the scheduler's look and its lend.
    settings = two_replicas(tmp_path, lent=False)
    swaps = fake_swaps(monkeypatch, settings)
    scheduler = Scheduler(settings)
    monkeypatch.setattr(Scheduler, "rollout_version", lambda self: SimpleNamespace(version="v5", model_dir="/m"))
    with liverl.pool.replica_lock(settings, "r1"):  # the controller's swap holds it
        liverl.pool.set_replica(settings, "r1", policy_version="v4")
        liverl.pool.set_aliases(settings, canary="v4")
        lending = threading.Thread(target=lambda: swaps.append(
            scheduler.lend(Decision("lend", "r1", 0.0, "quiet"), time.time())))
        lending.start()
        time.sleep(0.3)
        assert lending.is_alive()  # waits for the replica
    lending.join(timeout=10)
    assert swaps == [None] and versions(settings)["r1"] == ("v4", None, True)


def test_a_canary_is_not_started_on_a_replica_lent_meanwhile(monkeypatch, tmp_path):
    from promotion.promoter import Promoter
    settings = two_replicas(tmp_path, lent=False)
    swaps = fake_swaps(monkeypatch, settings)
    registry = SimpleNamespace(get=lambda v: SimpleNamespace(state="canary"), stable=lambda: SimpleNamespace(
        version="v3"), update_metrics=lambda *a, **k: None)
    real_read = liverl.pool.read_pool
    looks = []

    def read_then_lend(s):  # the scheduler lends r0 right after the controller's first look
        looks.append(True)
        pool = real_read(s)
        if len(looks) == 1:
            liverl.pool.set_replica(settings, "r0", alias=ROLLOUT, policy_version="v5")
        return pool
    monkeypatch.setattr("promotion.promoter.read_pool", read_then_lend)
    Promoter(settings, registry).start_canary("v4", "controller", "gate passed")
    assert swaps == [("r1", "v4")]  # not r0, which rollouts have now


def test_the_demo_day_lends_only_with_no_production_and_the_first_request_takes_it_back():
    # On two shared cores a lent replica's rollouts take the CPU production needs: one user
    # beside them answers at 1.6-2.2x its p99 alone (benchmarks/bench_harvest.py), so the
    # demo's day lends nothing beside the night shift's one user.
    rules = Hysteresis(demo_settings(day=True).capacity)
    night_shift = [rules.decide(t / 2, load({"r1": 1}), pool(), False) for t in range(120)]
    assert night_shift == [None] * 120
    assert [rules.decide(60 + t, load(), pool(), False) for t in range(10)] == [None] * 10
    assert rules.decide(70.1, load(), pool(), False).action == "lend"
    back = rules.decide(70.2, load({"r1": 1}), pool(lent=1), False)  # the morning's first user
    assert back.action == "take_back" and back.replica == "r0"


def test_two_doors_pausing_at_once_both_succeed(tmp_path):
    """The dashboard (through the controller) and the CLI (through the scheduler) may
    write the pause at the same moment: neither fails, and one whole pause is kept."""
    from datetime import datetime

    from liverl.lending import LendingPause

    settings = Settings(data_dir=tmp_path)
    settings.run_dir.mkdir(parents=True)
    failed: list[Exception] = []

    def pause(actor: str) -> None:
        for _ in range(300):
            try:
                set_pause(settings, LendingPause(actor=actor, reason="an incident", at=datetime.now(UTC)))
            except Exception as error:  # noqa: BLE001 - any failure is the finding
                failed.append(error)

    doors = [threading.Thread(target=pause, args=(actor,)) for actor in ("dashboard", "cli")]
    for door in doors:
        door.start()
    for door in doors:
        door.join()
    assert not failed, failed[:3]
    assert read_pause(settings).actor in ("dashboard", "cli")
