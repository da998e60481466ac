"""What the learner decides from its bookkeeping alone: which complete rollout groups a
version takes beside production samples (the mix), and how far its chain runs ahead of
what serves (`learner.max_lead_versions`)."""

from __future__ import annotations

import shutil
import time
from types import SimpleNamespace

from learner.service import OpenGroup, choose_groups, unserved_chain

# The learner's drop counter, stubbed: these tests read what it decides, not what it counts.
UNCOUNTED = SimpleNamespace(labels=lambda reason: SimpleNamespace(inc=lambda: 0))


def groups(*sizes: int) -> list[OpenGroup]:
    made = [OpenGroup(size=n, policy_version="v1", opened=float(i)) for i, n in enumerate(sizes)]
    return list(reversed(made))  # arrival order is by `opened`, not list order


def test_without_a_share_every_complete_group_is_taken_oldest_first():
    taken = choose_groups(groups(4, 4, 8), production=100, share=None)
    assert [g.opened for g in taken] == [0.0, 1.0, 2.0]


def test_a_share_caps_rollouts_with_whole_groups_in_arrival_order():
    # 24 production samples at a quarter rollouts: room for 8 rollout samples.
    taken = choose_groups(groups(4, 8, 4), production=24, share=0.25)
    assert [(g.opened, g.size) for g in taken] == [(0.0, 4)]  # the 8 does not fit whole, and nothing jumps it
    assert [g.size for g in choose_groups(groups(4, 4, 8), production=24, share=0.25)] == [4, 4]
    assert choose_groups(groups(16), production=24, share=0.25) == []


def test_rollouts_train_alone_when_no_production_sample_waits():
    assert len(choose_groups(groups(4, 4), production=0, share=0.1)) == 2


def test_the_chain_ahead_of_what_serves_is_counted_back_to_the_first_served_version():
    # v1 stable <- v2 <- v3 <- v4, the learner at v4; v3 also in canary in the second case.
    chain = {f"v{i}": SimpleNamespace(version=f"v{i}", parent=f"v{i - 1}" if i > 1 else None) for i in range(1, 5)}
    assert unserved_chain(chain["v4"], {"v1"}, chain.get, most=10) == 3
    assert unserved_chain(chain["v4"], {"v1", "v3"}, chain.get, most=10) == 1
    assert unserved_chain(chain["v1"], {"v1"}, chain.get, most=10) == 0
    assert unserved_chain(chain["v4"], {"v1"}, chain.get, most=2) == 2  # stops counting at the bound
    assert unserved_chain(chain["v4"], set(), chain.get, most=10) == 4  # nothing serves: all of it


def test_a_drain_ends_when_only_incomplete_groups_hold_the_learner_back(monkeypatch):
    """`liverl down` cannot wait out a group missing members (it never completes before the
    group timeout); with nothing else lagging and nothing pending, three equal readings end
    the drain, and the held offsets are read again at the next start. (The learner's health
    is faked: an incomplete group on demand needs a member lost upstream.)"""
    from app.stack import only_open_groups_left
    from liverl.settings import Settings

    health = {"pending": 0, "open_groups": 1}

    class Answer:
        def json(self):
            return dict(health)
    monkeypatch.setattr("app.stack.httpx.get", lambda *a, **k: Answer())
    settings = Settings()
    held: list[dict] = []
    lags = {"liverl-feedback": 0, "liverl-sink": 0, "liverl-learner": 3}
    assert [only_open_groups_left(settings, lags, held) for _ in range(3)] == [False, False, True]
    held.clear()
    health["pending"] = 2  # samples still to train: the drain goes on
    assert not any(only_open_groups_left(settings, lags, held) for _ in range(4))
    health.update(pending=0, open_groups=0)  # a plain lag: the drain goes on
    assert not any(only_open_groups_left(settings, lags, held) for _ in range(4))
    health["open_groups"] = 1
    assert not any(only_open_groups_left(settings, {**lags, "liverl-sink": 5}, held) for _ in range(4))


def test_a_drain_names_a_dead_learner_instead_of_failing_on_its_port(tmp_path, monkeypatch):
    """The learner died (a crash in training) with its offsets committed, while the sink
    still catches up: the drain's /flush finds nobody at the port. It must say the learner
    died (a StackError `liverl down` and the benchmarks report), not raise a bare
    ConnectError that leaves the stack up. (The lags are faked: a broker that holds one
    group back on demand is not at hand.)"""
    import subprocess
    import sys

    import httpx
    import pytest

    from app.stack import StackError, drain
    from liverl.manifest import Component, Manifest, manifest_file
    from liverl.settings import Settings

    monkeypatch.setenv("LIVERL_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LIVERL_ADMIN_KEY", "lrl_adm_test")
    settings = Settings()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    manifest_file(settings).parent.mkdir(parents=True)
    manifest_file(settings).write_text(Manifest(cluster_id="c", started_at=0, components=[
        Component(name="learner", pid=gone.pid, log="learner.log")]).model_dump_json())
    lags = {"liverl-feedback": 0, "liverl-sink": 4, "liverl-learner": 0}

    async def lag(_settings, group, _topics):
        return lags[group]

    def refused(*_args, **_kwargs):
        raise httpx.ConnectError("[Errno 111] Connection refused")
    monkeypatch.setattr("app.stack.group_lag", lag)
    monkeypatch.setattr("app.stack.httpx.post", refused)
    with pytest.raises(StackError, match="learner died"):
        drain(settings, timeout=5, say=lambda _: None)


def learner_with(config: dict, pending: int = 0, groups_waiting: list[OpenGroup] = (), current_seq: int = 5):
    """The learner's bookkeeping alone (no broker, no registry, no model)."""
    from learner.service import Learner
    from liverl.settings import LearnerConfig

    learner = Learner.__new__(Learner)
    learner.config = LearnerConfig(**config)
    learner.pending = {f"s{i}": None for i in range(pending)}
    learner.open_groups = {f"g{i}": g for i, g in enumerate(groups_waiting)}
    learner.window_started = time.time()
    learner.dropped, learner.dropped_ids = {"stale": 0, "incomplete_group": 0, "uniform_group": 0}, []
    learner.current = SimpleNamespace(seq=current_seq, version=f"v{current_seq}")
    learner.serving, learner.steps_behind = set(), {}
    learner.registry = SimpleNamespace(  # one straight lineage: v5 is v4's child
        steps_apart=lambda version, other, limit: abs(int(version[1:]) - int(other[1:]))
        if abs(int(version[1:]) - int(other[1:])) <= limit else None)
    return learner


def complete(size: int, version: str, opened: float = 0.0) -> OpenGroup:
    group = OpenGroup(size=size, policy_version=version, opened=opened)
    group.members = {f"{version}-{opened}-{i}": None for i in range(size)}
    return group


def test_a_version_is_due_for_what_it_will_train_not_for_groups_the_share_holds_back(monkeypatch):
    # 10 production samples at half rollouts leave room for one group of 8: 18 samples,
    # not the batch of 96 that 25 waiting groups seemed to make (a version of 18 at every poll).
    monkeypatch.setattr("learner.service.DROPPED", UNCOUNTED)
    waiting = [complete(8, "v5", opened=float(i)) for i in range(25)]
    learner = learner_with({"batch_samples": 96, "rollout_share": 0.5}, pending=10, groups_waiting=waiting)
    assert not learner.due()
    learner = learner_with({"batch_samples": 96, "rollout_share": 0.5}, pending=60, groups_waiting=waiting)
    assert learner.due()  # 60 production and 56 of rollouts
    assert learner_with({"batch_samples": 96}, pending=0, groups_waiting=waiting).due()  # rollouts alone


def test_a_group_the_share_held_back_past_the_version_lag_is_dropped_as_stale_not_trained(monkeypatch):
    monkeypatch.setattr("learner.service.DROPPED", UNCOUNTED)
    # 8 production samples at a share of a half: room for one group of 8 per version.
    first, second = complete(8, "v1", opened=1.0), complete(8, "v1", opened=2.0)
    learner = learner_with({"max_version_lag": 3, "rollout_share": 0.5}, pending=8, groups_waiting=[first, second],
                           current_seq=2)
    assert learner.take_groups() == [first] and second.passed_over == 1  # v1 is one behind: it waits
    learner.current = SimpleNamespace(seq=5, version="v5")  # versions went by; v1 is four behind now
    assert learner.take_groups() == [] and learner.open_groups == {} and learner.dropped["stale"] == 8
    # A group that only just completed arrived fresh (its members were checked as they came):
    # it trains, as a lone sample that arrived fresh does.
    just_complete = complete(8, "v1", opened=3.0)
    learner = learner_with({"max_version_lag": 3}, groups_waiting=[just_complete], current_seq=5)
    assert learner.take_groups() == [just_complete]
    held = complete(8, "v1", opened=4.0)
    held.passed_over = 2
    learner = learner_with({"max_version_lag": 3, "rollout_share": 0.5}, pending=8, groups_waiting=[held],
                           current_seq=5)
    learner.serving = {"v1"}  # what serves now is never stale
    assert learner.take_groups() == [held]


def test_what_lent_replicas_serve_counts_as_serving(tmp_path):
    from learner.service import Learner
    from liverl.pool import ROLLOUT, Pool, Replica, write_pool
    from liverl.settings import Settings

    learner = Learner.__new__(Learner)
    learner.settings = Settings(data_dir=tmp_path)
    learner.registry = SimpleNamespace(
        in_state=lambda state: [SimpleNamespace(version="v3")] if state == "stable" else [])
    write_pool(learner.settings, Pool(replicas=[
        Replica(name="r0", url="u", policy_version="v3", model_dir="/m"),
        Replica(name="r1", url="u", policy_version="v9", model_dir="/m", alias=ROLLOUT)]))
    # Rollouts sample the learner's newest version: its chain is not "ahead of what serves"
    # (max_lead_versions would rewind it to stable), and those samples are not stale.
    assert learner.serving_versions() == {"v3", "v9"}


def member(group: str, index: int, reward: float, size: int = 4) -> SimpleNamespace:
    """A rollout group's member as the learner reads it (the fields `gather` looks at)."""
    trajectory = SimpleNamespace(group_id=group, group_size=size, policy_version="v5")
    return SimpleNamespace(sample_id=f"{group}-{index}", tenant="rollouts", revision=0, reward=reward,
                           trajectory=trajectory)


def test_a_group_whose_rewards_are_all_equal_is_dropped_when_asked_and_counts_toward_no_batch(monkeypatch):
    # DAPO's dynamic sampling: all solved (or all failed), a group's advantages are all 0; it
    # would fill a version's batch with nothing to learn. Held-out groups still reach the gate.
    from kafka import TopicPartition

    monkeypatch.setattr("learner.service.DROPPED", UNCOUNTED)
    monkeypatch.setattr("learner.service.held_out", lambda sample, fraction: sample.trajectory.group_id == "kept-out")
    learner = learner_with({"batch_samples": 8, "drop_uniform_groups": True})
    tp = TopicPartition("trajectories", 0)
    for offset, (group, rewards) in enumerate([("solved", [1, 1, 1, 1]), ("failed", [0, 0, 0, 0]),
                                               ("split", [1, 0, 0, 1]), ("kept-out", [1, 1, 1, 1])]):
        for i, reward in enumerate(rewards):
            learner.gather(member(group, i, float(reward)), b"", (tp, 4 * offset + i))
    assert set(learner.open_groups) == {"rollouts:split", "rollouts:kept-out"}
    assert learner.dropped["uniform_group"] == 8
    learner.next_offsets = {tp: 16}
    assert learner.safe_offsets() == {tp: 8}  # held back by the split group only: the dropped ones are done
    learner.open_groups.pop("rollouts:kept-out")
    assert not learner.due()  # 4 samples to train: the two dropped groups counted toward nothing

    kept = learner_with({"batch_samples": 8})  # the default: every complete group trains
    for i, reward in enumerate([1, 1, 1, 1]):
        kept.gather(member("solved", i, float(reward)), b"", (tp, i))
    assert set(kept.open_groups) == {"rollouts:solved"} and kept.dropped["uniform_group"] == 0


def test_staleness_counts_training_steps_from_the_learners_weights_not_version_numbers(tmp_path, starter_dir):
    """A sample is stale when its behaviour policy is more than `max_version_lag` parent
    links from the weights the learner trains. Versions registered meanwhile on other
    branches (a rejected chain, an import) do not age it; a rejected chain's own samples are
    as far as its branch is long (CI, Nov 30: a rollout group of the learner's parent was
    dropped as 4 "behind" after tests had registered three versions beside it)."""
    from policies.registry import Registry

    registry = Registry(tmp_path / "policies")

    def publish(parent: str | None) -> str:
        staged = tmp_path / f"staged-{registry.latest().seq + 1 if registry.latest() else 0}"
        shutil.copytree(starter_dir, staged)
        return registry.publish(staged, parent=parent, window=None, metrics={}, sample_ids=[],
                                actor="test").version
    v0 = publish(None)
    v1 = publish(v0)
    v2 = publish(v0)  # a rejected chain off v0: v2 -> v3 -> v4
    v3 = publish(v2)
    v4 = publish(v3)
    imported = publish(None)
    current = publish(v1)  # the learner's: v6, parent v1
    learner = learner_with({"max_version_lag": 3})
    learner.registry, learner.current = registry, registry.get(current)
    assert registry.steps_apart(v1, current, 3) == 1 and not learner.stale(v1)  # five numbers apart
    assert registry.steps_apart(v0, current, 3) == 2 and not learner.stale(v0)
    assert registry.steps_apart(v4, current, 10) == 5 and learner.stale(v4)  # two numbers apart
    assert registry.steps_apart(v3, current, 3) is None and learner.stale(v3)
    assert learner.stale(imported) and learner.stale("v99")  # unrelated; unknown
    learner.serving = {v4}
    assert not learner.stale(v4)  # what serves never is
