"""Promotion goes on after a fault mid-canary. A controller killed while its canary is out
(the live guard off: canary then every replica at once) must, once started again, finish
that canary or take it off: a version left in canary holds every later promotion back. A
canary whose swap failed (a replica killed mid-swap) must not stop every later one either."""

import shutil
import uuid

import pytest

from liverl.settings import EmbeddedBroker, PromotionConfig, Settings
from policies.registry import Registry
from promotion.controller import Controller
from promotion.promoter import Promoter


class Killed(BaseException):
    """Stands in for kill -9 at one line (a real kill cannot be aimed at a line): nothing
    after it runs, and the controller's own error handling does not catch it."""


def test_a_controller_killed_mid_canary_finishes_it_after_a_restart(tmp_path, starter_dir, monkeypatch):
    settings = Settings(data_dir=tmp_path, broker=EmbeddedBroker(port=1),  # no broker: announcements fail at once
                        promotion=PromotionConfig(auto_promote=True, canary_guard=False))
    registry = Registry(settings.policies_dir)

    def publish(state: str, parent: str | None = None, metrics: dict | None = None) -> str:
        staged = tmp_path / f"staged-{uuid.uuid4().hex}"
        shutil.copytree(starter_dir, staged)
        return registry.publish(staged, parent=parent, window=None, metrics=metrics or {}, sample_ids=[],
                                actor="test", state=state).version

    stable = publish("stable")
    candidate = publish("candidate", stable, {"gate": {"passed": True}})

    def killed(*args, **kwargs):
        raise Killed

    with monkeypatch.context() as patch:  # its canary is out; it dies before finishing
        patch.setattr(Promoter, "finish", killed)
        with pytest.raises(Killed):
            Controller(settings).step()
    assert registry.get(candidate).state == "canary"
    restarted = Controller(settings)
    for _ in range(3):
        restarted.step()
    assert registry.get(candidate).state == "stable", restarted.state
    assert registry.get(stable).state == "superseded"


def test_after_a_canary_swap_fails_the_learners_next_candidate_is_promoted(tmp_path, starter_dir, monkeypatch):
    """A replica killed mid-swap rolls its canary back; later candidates must not all be
    rejected as continuing that version (the fault suite saw 235 in a row, and promotion
    stopped for good): the learner goes on from stable."""
    from liverl.pool import Pool, Replica, read_pool, set_replica, write_pool
    from serving.swap import SwapReport

    settings = Settings(data_dir=tmp_path, broker=EmbeddedBroker(port=1),
                        promotion=PromotionConfig(auto_promote=True, canary_guard=False))
    registry = Registry(settings.policies_dir)

    def publish(state: str = "candidate") -> str:  # as the learner does: on top of its head
        staged = tmp_path / f"staged-{uuid.uuid4().hex}"
        shutil.copytree(starter_dir, staged)
        head = registry.head()
        return registry.publish(staged, parent=head.version if head else None, window=None,
                                metrics={"gate": {"passed": True}}, sample_ids=[], actor="test", state=state).version

    stable = publish("stable")
    write_pool(settings, Pool(replicas=[Replica(name="replica-0", url="unix:/nowhere", policy_version=stable,
                                                model_dir=registry.get(stable).model_dir)]))

    def swap(ok: bool):
        def replace_replica(settings, name, version, model_dir, enable=True):
            # Stands in for the swap (no engine here): its outcome is what is tested.
            if ok:
                set_replica(settings, name, policy_version=version, model_dir=str(model_dir))
            return SwapReport(replica=name, version=version, ok=ok, mode="inplace",
                              error=None if ok else "ConnectError: the engine was killed", reverted=not ok)
        return replace_replica

    monkeypatch.setattr("serving.swap.replace_replica", swap(ok=False))
    failed = publish()
    Controller(settings).step()
    assert registry.get(failed).state == "rolled_back"
    monkeypatch.setattr("serving.swap.replace_replica", swap(ok=True))
    following = publish()
    Controller(settings).step()
    assert registry.get(following).state == "stable", registry.history(following)
    assert read_pool(settings).get("replica-0").policy_version == following
