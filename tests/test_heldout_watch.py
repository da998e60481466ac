"""The held-out watch: a stable version whose held-out pass rate is surely below the best
recent stable's, task by task on the same tasks, is named in its history and on-call is
alerted once per spell; a drop within the noise, or figures on other tasks, say nothing."""

from __future__ import annotations

import shutil

import pytest
from helpers import alert_receiver, wait_for

from app.stack import heldout_status
from liverl.settings import PromotionConfig, Settings
from policies.registry import Registry
from promotion.controller import Controller
from promotion.sequential import paired_loss_p


def test_the_sign_test_counts_only_the_tasks_one_version_solves():
    assert paired_loss_p(0, 0) == 1.0  # nothing differs: no evidence
    assert paired_loss_p(5, 0) == 1 / 32  # five lost, none gained: 1/2 ** 5 by luck
    assert paired_loss_p(3, 1) == 5 / 16  # P(X >= 3), X ~ Binomial(4, 1/2)
    assert paired_loss_p(5, 5) > 0.5  # as many gained as lost


class Stables:
    """A registry where each new version the evaluator scored is promoted over the last,
    and the controller's held-out watch looks at it."""

    def __init__(self, tmp_path, starter_dir, **promotion):
        self.alerts, self.webhook = alert_receiver()
        settings = Settings(data_dir=tmp_path, promotion=PromotionConfig(
            alert_webhook=f"http://127.0.0.1:{self.webhook.server_port}/alerts", **promotion))
        self.tmp_path, self.starter_dir = tmp_path, starter_dir
        self.registry = Registry(settings.policies_dir)
        self.controller = Controller(settings)

    def promote(self, solved: str | None, task_set: str = "these-tasks") -> str:
        """A new stable version, scored `solved` (None: not yet)."""
        staged = self.tmp_path / f"staged-{len(self.registry.versions())}"
        shutil.copytree(self.starter_dir, staged)
        old = self.registry.stable()
        version = self.registry.publish(staged, parent=old.version if old else None, window=None, metrics={},
                                        sample_ids=[], actor="test", state="candidate" if old else "stable").version
        if old:
            self.registry.transition(version, "canary", "test", "gate passed")
            self.registry.transition(old.version, "superseded", "test", f"{version} promoted")
            self.registry.transition(version, "stable", "test", "non-inferior")
        if solved is not None:
            self.score(version, solved, task_set)
        return version

    def score(self, version: str, solved: str, task_set: str = "these-tasks") -> None:
        self.registry.update_metrics(version, heldout={
            "pass_rate": solved.count("1") / len(solved), "tasks": len(solved), "solved": solved, "task_set": task_set})
        self.controller.next_heldout_check = 0.0  # it looks every ten polls: now
        self.controller.watch_heldout()

    def regressions(self, version: str) -> list[str]:
        return [e["reason"] for e in self.registry.history(version) if e["to"] == "heldout_regression"]


def test_a_stable_that_lost_the_held_out_skill_is_alerted_once_per_spell(tmp_path, starter_dir):
    stables = Stables(tmp_path, starter_dir)
    skilled = "1" * 10 + "0" * 10
    first = stables.promote(skilled)
    assert stables.regressions(first) == []  # nothing earlier to compare with
    assert stables.regressions(stables.promote("0011111111" + "0" * 10)) == []  # two lost: p 1/4, noise

    gone = stables.promote("0" * 20)  # all ten lost, none gained: p 1/1024
    assert "10 lost, 0 gained" in stables.regressions(gone)[0] and first in stables.regressions(gone)[0]
    alert = wait_for(lambda: stables.alerts and stables.alerts[0], timeout=10)
    assert alert["event"] == "heldout_regression" and alert["version"] == gone
    assert alert["best"] == first and alert["lost"] == 10 and alert["gained"] == 0

    # Scored on other tasks (the environment or heldout_tasks changed): not compared.
    assert stables.regressions(stables.promote("0" * 20, task_set="other-tasks")) == []
    still = stables.promote("0" * 20)  # the same spell: in its history, no second alert
    assert stables.regressions(still)
    stables.controller = Controller(stables.controller.settings)  # restarted: looks at `still` again
    stables.controller.watch_heldout()
    assert len(stables.regressions(still)) == 1  # recorded once, and not alerted again
    assert stables.regressions(stables.promote(skilled)) == []  # the skill back: the spell ends
    again = stables.promote("0" * 20)  # a new spell: alerted again
    assert stables.regressions(again)
    wait_for(lambda: len(stables.alerts) == 2, timeout=10)
    assert [a["version"] for a in stables.alerts] == [gone, again]
    stables.webhook.shutdown()


def test_a_stable_replaced_while_it_was_scored_is_still_watched(tmp_path, starter_dir):
    """An evaluation takes seconds and so does a canary: by the time a stable's figures
    are in, the next stable may serve. What users got is compared all the same."""
    stables = Stables(tmp_path, starter_dir)
    stables.promote("11111")
    replaced = stables.promote(None)
    stables.promote(None)  # the next stable, not scored yet
    stables.score(replaced, "00000")
    assert "5 lost, 0 gained" in stables.regressions(replaced)[0]
    stables.webhook.shutdown()


@pytest.mark.parametrize("earlier, alerted", [(1, True), (2, False)])
def test_the_best_of_several_stables_is_compared_at_a_stricter_level(tmp_path, starter_dir, earlier, alerted):
    """Five of five lost is p 1/32: below 0.05 against one earlier stable, not against
    the best of two (Bonferroni: 0.025), since the best of several looks better by luck."""
    stables = Stables(tmp_path, starter_dir)
    for _ in range(earlier):
        stables.promote("11111")
    assert bool(stables.regressions(stables.promote("00000"))) is alerted
    stables.webhook.shutdown()


def test_status_shows_held_out_figures_and_lost_skill(tmp_path, starter_dir):
    """On-call sees the evaluator's latest held-out figures and which versions the held-out
    watch found had lost held-out skill, from the registry."""
    registry = Registry(tmp_path / "policies")
    versions = []
    for solved in ("11110", "10000"):
        staged = tmp_path / f"staged-{len(versions)}"
        shutil.copytree(starter_dir, staged)
        versions.append(registry.publish(staged, parent=versions[-1] if versions else None, window=None,
                                         metrics={}, sample_ids=[], actor="test").version)
        registry.update_metrics(versions[-1], heldout={"pass_rate": solved.count("1") / 5, "tasks": 5,
                                                       "solved": solved, "task_set": "t"})
    registry.record_event(versions[-1], "heldout_regression", "controller", "3 lost, 0 gained")
    assert heldout_status(registry) == [
        {"version": versions[0], "state": "candidate", "pass_rate": 0.8, "tasks": 5, "lost_skill": False},
        {"version": versions[1], "state": "candidate", "pass_rate": 0.2, "tasks": 5, "lost_skill": True}]
