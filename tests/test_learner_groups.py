"""What the learner decides from its bookkeeping alone: which complete rollout groups a
version takes beside production samples (the mix), and how far its chain runs ahead of
what serves (`learner.max_lead_versions`)."""

from __future__ import annotations

from types import SimpleNamespace

from learner.service import OpenGroup, choose_groups, unserved_chain


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
