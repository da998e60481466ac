"""The demo reports what users saw, not the best version's (biased) rate, and never wipes a
running demo; its simulated day has troughs with no traffic, and production latency is
split by whether a replica was lent when each request was sent."""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime

import pytest

from app.demo import (
    Population,
    Request,
    Tally,
    capacity_summary,
    day_load,
    harvest,
    lent_intervals,
    regressions,
    summary,
    take_back_seconds,
)
from liverl.contracts import CapacityEvent


def tally(start: float, verdicts: list[bool]) -> Tally:
    """One verdict a second from `start`."""
    return Tally(served=len(verdicts), accepted=sum(verdicts), first_at=start,
                 log=[(start + i, ok) for i, ok in enumerate(verdicts)])


def test_a_stable_regression_is_a_version_clearly_worse_than_the_one_it_replaced():
    """The issue's count: 95% Wilson upper bound more than 10 points under the replaced
    version's rate, among versions served at least 200 times."""
    rows = [{"policy_version": v, "n": n, "accept_rate": rate} for v, n, rate in
            [("v0", 1000, 0.80), ("v1", 400, 0.64), ("v2", 400, 0.60), ("v3", 150, 0.10), ("v4", 300, 0.60)]]
    worse = regressions(["v0", "v1", "v2", "v3", "v4"], rows)
    # v1: 0.64 of 400 has an upper bound of 0.686, under 0.80 - 0.10; v2 is close to v1; v3
    # served too few to count; v4 replaced v3 (0.10) and is better.
    assert [(w["version"], w["replaced"]) for w in worse] == [("v1", "v0")]
    assert worse[0]["upper"] == pytest.approx(0.686, abs=1e-3)
    # Each is judged against what it replaced in `order`: v2 straight after v0 is one too.
    assert regressions(["v0", "v2"], rows)[0]["version"] == "v2"


def test_the_last_two_minutes_and_the_time_to_forty_points():
    # v0 accepts 1 in 10 for 200 s; v1 9 in 10 for 100 s; v2, the last 100 s, 1 in 2.
    tallies = {"v0": tally(0, [i % 10 == 0 for i in range(200)]),
               "v1": tally(200, [i % 10 != 0 for i in range(100)]),
               "v2": tally(300, [i % 2 == 0 for i in range(100)])}
    result = summary(tallies)
    assert result["starter"]["accept_rate"] == pytest.approx(0.1)
    # The last 120 s (from 279 s to 399 s): 21 of v1's verdicts (19 accepted), all 100 of v2's (50).
    recent = result["last_two_minutes"]
    assert recent["served"] == 121 and recent["accept_rate"] == pytest.approx(69 / 121)
    assert recent["ci"][0] < 69 / 121 < recent["ci"][1]
    # At 200 + k s the last 100 verdicts are v0's last 99 - k and v1's first k + 1; at k = 49
    # that is 5 + 45 accepted: 0.5, the starter's 0.1 plus 40 points (at k = 48, 49).
    assert result["time_to_plus_40_s"] == 249
    assert result["best"]["version"] == "v1"  # the maximum over versions, kept for reference


def test_a_run_that_never_rose_forty_points_says_so():
    tallies = {"v0": tally(0, [i % 10 == 0 for i in range(300)])}
    assert summary(tallies)["time_to_plus_40_s"] is None


def test_a_second_demo_refuses_to_wipe_a_running_one(tmp_path, monkeypatch):
    """`liverl demo` starts by wiping its data directory; a second one started while the
    first runs must refuse, not delete the running demo's registry under it."""
    from typer.testing import CliRunner

    from app.cli import app
    from app.demo import demo_settings
    from liverl.manifest import Component, Manifest, manifest_file

    monkeypatch.setenv("LIVERL_DATA_DIR", str(tmp_path))
    settings = demo_settings()
    manifest_file(settings).parent.mkdir(parents=True)
    alive_component = Component(name="learner", pid=os.getpid(), log="learner.log")
    manifest_file(settings).write_text(Manifest(cluster_id="c", started_at=0, components=[alive_component])
                                       .model_dump_json())
    result = CliRunner().invoke(app, ["demo", "--minutes", "0.1"])
    assert result.exit_code == 1 and "already running" in result.output
    assert manifest_file(settings).exists()


def test_a_simulated_day_has_a_trough_with_one_user_then_none_and_a_full_peak():
    day, users = 240.0, 8
    active = [sum(i < users * day_load(t, day) for i in range(users)) for t in range(0, 240)]
    assert active[0] == 0 and active[120] == users  # midnight and noon
    night_shift = [t for t, n in enumerate(active) if n == 1 and t >= 120]
    nobody = [t for t, n in enumerate(active) if n == 0]
    # Long enough to lend a replica beside one user, then to see it generate alone.
    assert 0.1 < len(night_shift) / day < 0.2 and 0.1 < len(nobody) / day < 0.2
    assert max(night_shift) == 239 and max(nobody) < 120  # the evening, then after midnight
    assert all(0 <= day_load(t, day) <= 1 for t in range(0, 240))


def test_capacity_summary_splits_latency_by_lent_periods():
    pop = Population.__new__(Population)  # only what the summary reads: no stack needed
    pop._lock, pop.started, pop.load = threading.Lock(), 1_000.0, lambda t: 1.0 if t >= 25 else 0.0
    # Requests sent at 5 s (lent: 1 s) and 30 s (not lent: 3 s at 24 tokens, the longest;
    # 4 s at 11), and one that failed.
    pop.requests = [Request(5.0, 1.0, True, 24, "replica-0"), Request(30.0, 3.0, True, 24, "replica-1"),
                    Request(30.5, 4.0, True, 11, "replica-0"), Request(31.0, 0.1, False, 0)]

    def event(action: str, at: float, seconds: float = 0.0) -> CapacityEvent:
        return CapacityEvent(action=action, replica="replica-1", policy_version="v1", load=0.0, why="test",
                             seconds=seconds, timestamp=datetime.fromtimestamp(1_000.0 + at, UTC))
    result = capacity_summary(pop, [event("lend", 2.0), event("take_back", 20.0, seconds=1.5)], {"groups": 3})
    assert result["lent"] == [(2.0, 20.0, "replica-1")]
    assert result["latency_p99_s"] == {"lent": 1.0, "not_lent": 4.0, "peak": 4.0, "peak_full_length": 3.0}
    assert result["peak_completion_tokens"] == 17.5  # the peak's two answered requests
    assert result["take_back_s"]["max"] == 1.5 and result["production_failed"] == 1
    assert result["rollout_groups"] == 3 and result["lent_seconds"] == 18.0


def test_harvest_compares_lent_time_with_a_lent_replica_alone():
    lent = [(0.0, 4.0, "replica-1")]
    load = [(0.0, 0), (1.0, 0), (2.0, 3), (3.0, 3), (4.0, 3)]  # users active at each second
    tokens = [(0.0, 0), (1.0, 100), (2.0, 200), (3.0, 250), (4.0, 300), (5.0, 300)]
    result = harvest(lent, load, tokens)
    assert result["tokens_per_s_alone"] == 100  # 0-2 s: no production
    assert result["tokens_per_s_lent"] == 75  # 0-4 s: 300 tokens; 4-5 s was not lent
    assert result["share"] == 0.75
    assert result["tokens_per_s_beside_production"] == 50 and result["seconds_beside_production"] == 2.0


def test_a_failed_take_back_keeps_the_replica_lent_until_the_retry_and_counts_from_the_first_ask():
    def event(action: str, at: float, seconds: float = 0.0, error: str | None = None) -> CapacityEvent:
        return CapacityEvent(action=action, replica="replica-1", policy_version="v1", load=2.0, why="test",
                             seconds=seconds, error=error, timestamp=datetime.fromtimestamp(at, UTC))
    events = [event("lend", 10.0), event("take_back", 20.0, 1.0, error="swap failed"), event("take_back", 31.0, 0.5)]
    assert lent_intervals(events, 0.0, 40.0) == [(10.0, 31.0, "replica-1")]
    assert take_back_seconds(events) == [12.0]  # asked at 19 s, serving production at 31 s


def test_capacity_summary_counts_production_answered_by_a_lent_replica_and_retried_requests():
    """The day's evidence that production never went to a lent replica, and that its "0
    failed" is not a client quietly retrying: both are counted, not assumed."""
    pop = Population.__new__(Population)
    pop._lock, pop.started, pop.load = threading.Lock(), 1_000.0, lambda t: 0.0
    pop.requests = [Request(5.0, 1.0, True, 24, "replica-0"),
                    Request(6.0, 0.5, True, 24, "replica-1"),  # sent and answered while replica-1 was lent
                    Request(19.9, 0.5, True, 24, "replica-1"),  # answered after it came back
                    Request(7.0, 0.9, True, 24, "replica-0", retries=1)]

    def event(action: str, at: float) -> CapacityEvent:
        return CapacityEvent(action=action, replica="replica-1", policy_version="v1", load=0.0, why="test",
                             seconds=0.1, timestamp=datetime.fromtimestamp(1_000.0 + at, UTC))
    result = capacity_summary(pop, [event("lend", 2.0), event("take_back", 20.0)], {})
    assert result["production_on_lent_replica"] == 1
    assert result["production_retried"] == 1 and result["production_failed"] == 0


def test_the_held_out_curve_keeps_what_the_evaluator_recorded_and_scores_the_rest(tmp_path, starter_dir):
    """The day's held-out curve spans the whole day: figures the held-out evaluator recorded
    while the stack ran are kept as recorded (also for a version whose weights retention has
    removed since, which could not be scored afterwards), versions nobody scored on these
    tasks are scored afterwards, and figures on other tasks are not mixed in."""
    import shutil

    from app.demo import heldout_by_version
    from liverl.settings import RolloutsConfig, Settings, StarterPolicyConfig
    from policies.registry import Registry
    from rollouts.coding import CodingEnvironment
    from rollouts.evaluate import greedy_pass_rate, task_set

    settings = Settings(data_dir=tmp_path, starter=StarterPolicyConfig(model_dir=starter_dir),
                        rollouts=RolloutsConfig(levels=[1]))
    registry = Registry(settings.policies_dir)
    environment = CodingEnvironment(levels=[1])
    held = environment.heldout(4)

    def publish(pass_rate: float | None = None, tasks: str = task_set(held)) -> str:
        staged = tmp_path / f"staged-{len(registry.versions())}"
        shutil.copytree(starter_dir, staged)
        version = registry.publish(staged, parent=None, window=None, metrics={}, sample_ids=[], actor="test",
                                   state="candidate").version
        if pass_rate is not None:  # as the evaluator records it
            registry.update_metrics(version, heldout={"pass_rate": pass_rate, "tasks": 4, "task_set": tasks})
        return version

    starter, scored_live, removed, other_tasks, unscored = (
        publish(0.25), publish(0.5), publish(0.75), publish(1.0, tasks="other"), publish())
    shutil.rmtree(registry.get(removed).model_dir)  # retention, after the evaluator scored it
    points = heldout_by_version(settings, registry.get(starter).created_at, 4)
    assert [(p["version"], p["pass_rate"], p["measured"]) for p in points[:3]] == [
        ("v0", 0.25, "live"), (scored_live, 0.5, "live"), (removed, 0.75, "live")]
    afterwards = greedy_pass_rate(starter_dir, environment, held)  # the same weights as the starter's
    assert [(p["version"], p["pass_rate"], p["measured"]) for p in points[3:]] == [
        (other_tasks, afterwards, "after"), (unscored, afterwards, "after")]


def test_each_stable_version_shows_production_and_held_out_skill_side_by_side(tmp_path, starter_dir):
    """The day's summary: per version that was stable, in that order, its production accept
    rate and its held-out pass rate on the day's tasks, whether it is below the starter by
    the held-out watch's test; and the candidates the skill guard held, with its verdict."""
    import shutil

    from app.demo import held_for_skill, stable_skill
    from liverl.settings import RolloutsConfig, Settings
    from policies.registry import Registry
    from rollouts.coding import CodingEnvironment
    from rollouts.evaluate import task_set

    settings = Settings(data_dir=tmp_path, rollouts=RolloutsConfig(levels=[1]))
    registry = Registry(settings.policies_dir)
    tasks = task_set(CodingEnvironment(levels=[1]).heldout(10))

    def version(solved: str | None, parent: str | None, state: str = "candidate") -> str:
        staged = tmp_path / f"staged-{len(registry.versions())}"
        shutil.copytree(starter_dir, staged)
        v = registry.publish(staged, parent=parent, window=None, metrics={}, sample_ids=[], actor="test",
                             state=state).version
        if solved is not None:
            registry.update_metrics(v, heldout={"pass_rate": solved.count("1") / 10, "tasks": 10, "solved": solved,
                                                "task_set": tasks})
        return v

    def promote(v: str) -> None:
        old = registry.stable().version
        registry.transition(v, "canary", "test", "gate passed")
        registry.transition(old, "superseded", "test", f"{v} promoted")
        registry.transition(v, "stable", "test", "non-inferior")

    v0 = version("1111100000", None, "stable")
    v1 = version("1111111000", v0)
    promote(v1)
    v2 = version("0000000000", v1)  # held: never stable
    registry.update_metrics(v2, skill={"verdict": "held"})
    registry.transition(v2, "rejected", "controller", "held for skill: coding: held-out pass rate 0.000 ...")
    v3 = version("1000000000", v1)  # four of the starter's five lost: p 1/16, not below by the test
    promote(v3)
    v4 = version("0000000000", v3)  # all five lost: p 1/32, below
    promote(v4)
    rows = [{"policy_version": v, "n": n, "accept_rate": rate} for v, n, rate in [(v0, 300, 0.25), (v1, 200, 0.9)]]
    assert [(r["version"], r["accept_rate"], r["served"], r["heldout_pass_rate"], r["below_starter"])
            for r in stable_skill(settings, rows, 10)] == [
        (v0, 0.25, 300, 0.5, False), (v1, 0.9, 200, 0.7, False), (v3, None, 0, 0.1, False),
        (v4, None, 0, 0.0, True)]
    assert [(h["version"], h["pass_rate"]) for h in held_for_skill(settings)] == [(v2, 0.0)]
    assert held_for_skill(settings)[0]["reason"].startswith("held for skill: coding")
