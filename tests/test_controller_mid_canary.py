"""A promotion controller killed while its canary is out (the live guard off: canary then
every replica at once) must, once started again, finish that canary or take it off: a
version left in canary holds every later promotion back and serves beside stable for ever."""

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
