"""The skill guard's verdict, without a stack: a candidate is judged on the held-out
evaluator's figures against the starter and stable (or the best recent stable), task by
task, before its canary; one that surely lost skill is held (rejected, with the evaluation
and its figures), the learner is asked to rewind, and what was trained on top of it never
reaches a canary."""

from __future__ import annotations

import shutil
import socket
import threading
import time

import pytest
import uvicorn

from liverl.settings import PortsConfig, PromotionConfig, RolloutsConfig, Settings
from policies.registry import Registry
from promotion.controller import Controller
from promotion.sequential import compare_skill
from rollouts.evaluator import Evaluator, create_app
from sync.retention import needs


def test_a_loss_is_surely_below_and_by_more_than_the_margin():
    # Ten lost, none gained of 20 tasks: p 1/1024, 0.5 points below.
    lost = compare_skill("coding", "v0", "1" * 10 + "0" * 10, "0" * 20, margin=0.05, level=0.05)
    assert lost.lost_skill and (lost.lost, lost.gained, lost.p) == (10, 0, 1 / 1024)
    assert "coding: held-out pass rate 0.000 against v0's 0.500 on the same 20 tasks (10 lost, 0 gained" in lost.text()
    # Surely below, but within the margin: 5 of 200 tasks lost is 2.5 points.
    small = compare_skill("coding", "v0", "1" * 5 + "0" * 195, "0" * 200, margin=0.05, level=0.05)
    assert small.p < 0.05 and not small.lost_skill
    # Far below in rate, but on 3 tasks: could be luck (p 1/8).
    assert not compare_skill("coding", "v0", "111", "000", margin=0.05, level=0.05).lost_skill
    # As many gained as lost: no loss, whatever the tasks that changed.
    assert not compare_skill("coding", "v0", "1100", "0011", margin=0.05, level=0.05).lost_skill
    with pytest.raises(ValueError, match="different task sets"):
        compare_skill("coding", "v0", "1010", "10", margin=0.05, level=0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def guarded(tmp_path, starter_dir):
    """A registry with the starter stable, the real held-out evaluator answering on its port
    (not looping: the test steps it), and a controller with the skill guard."""
    settings = Settings(data_dir=tmp_path, ports=PortsConfig(evaluator=free_port()),
                        promotion=PromotionConfig(auto_promote=True),
                        rollouts=RolloutsConfig(levels=[1, 2], heldout_every_s=600.0, heldout_tasks=20))
    registry = Registry(settings.policies_dir)
    staged = tmp_path / "staged-v0"
    shutil.copytree(starter_dir, staged)
    registry.publish(staged, parent=None, window=None, metrics={}, sample_ids=[], actor="test", state="stable")
    evaluator = Evaluator(settings)
    server = uvicorn.Server(uvicorn.Config(create_app(evaluator), host=settings.host,
                                           port=settings.ports.evaluator, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    yield settings, registry, evaluator, Controller(settings)
    server.should_exit = True


def candidate(settings, registry, starter_dir, parent: str) -> str:
    staged = settings.data_dir / f"staged-{len(registry.versions())}"
    shutil.copytree(starter_dir, staged)
    return registry.publish(staged, parent=parent, window=None, metrics={"gate": {"passed": True, "reason": "test"}},
                            sample_ids=[], actor="test").version


def test_a_candidate_waits_for_its_figures_and_as_good_as_both_goes_on(guarded, starter_dir):
    settings, registry, evaluator, controller = guarded
    good = candidate(settings, registry, starter_dir, "v0")
    stable = registry.stable()
    assert not controller.skill_passed(registry.get(good), stable)  # no figures yet: it waits, and asks
    assert "waits for its held-out evaluation" in controller.state
    evaluator.step()  # stable first (the reference) ...
    evaluator.step()  # ... then the candidate the controller asked for
    assert registry.get(good).metrics["heldout"]["task_set"] == registry.get("v0").metrics["heldout"]["task_set"]
    assert controller.skill_passed(registry.get(good), registry.stable())  # the starter's weights: lost nothing
    skill = registry.get(good).metrics["skill"]
    assert skill["verdict"] == "non_inferior" and [c["reference"] for c in skill["comparisons"]] == ["v0"]


def test_the_next_candidate_is_scored_while_a_canary_is_judged(guarded, starter_dir):
    """Its verdict is ready when the canary ends: the canary after it does not wait."""
    settings, registry, evaluator, controller = guarded
    canary = candidate(settings, registry, starter_dir, "v0")
    controller.ask_for_skill(registry.get(canary))
    evaluator.step()  # stable first (the reference) ...
    evaluator.step()  # ... then the candidate, before its canary
    registry.transition(canary, "canary", "test", "gate passed")  # by hand: the controller leaves it be
    following = candidate(settings, registry, starter_dir, canary)
    controller.step()
    assert registry.get(following).metrics["skill"]["verdict"] == "waiting"  # asked for ahead
    evaluator.step()
    registry.transition("v0", "superseded", "test", f"{canary} promoted")
    registry.transition(canary, "stable", "test", "non-inferior")
    assert controller.skill_passed(registry.get(following), registry.stable())
    assert registry.get(following).metrics["skill"]["waited_s"] == 0  # ready when the canary ended


def test_a_candidate_that_lost_skill_is_held_and_the_learner_rewinds(guarded, starter_dir):
    settings, registry, evaluator, controller = guarded
    evaluator.step()  # the starter's figures
    starter = registry.get("v0").metrics["heldout"]
    assert starter["solved"].count("1") >= 4, "the starter solves a few of the 20 tasks"
    lost = candidate(settings, registry, starter_dir, "v0")
    on_top = candidate(settings, registry, starter_dir, lost)
    registry.update_metrics(lost, heldout=dict(starter, solved="0" * 20, pass_rate=0.0))  # every task lost
    assert not controller.skill_passed(registry.get(lost), registry.stable())
    record = registry.get(lost)
    assert record.state == "rejected" and record.metrics["skill"]["verdict"] == "held"
    reason = registry.history(lost)[-1]["reason"]
    assert reason.startswith("held for skill: coding: held-out pass rate 0.000 against v0's")
    assert f"{starter['solved'].count('1')} lost, 0 gained" in reason
    rewind = registry.last_rewind()
    assert rewind is not None and rewind.version == "v0" and lost in rewind.reason
    # What the learner trained on top of it is rejected before the evaluator spends time on it.
    controller.take_candidate()
    assert registry.get(on_top).state == "rejected"
    assert f"trained on top of {lost}, held for skill" in registry.history(on_top)[-1]["reason"]


def test_a_skill_given_back_a_step_at_a_time_is_held_against_the_best_recent_stable(guarded, starter_dir):
    """No step is significant against the stable it replaces, but the candidate lost what an
    earlier stable had: with `skill_reference` best_recent, held against that one (the
    held-out watch's own reference); against stable alone, it passes."""
    settings, registry, evaluator, against_stable = guarded
    best_recent = settings.promotion.model_copy(update={"skill_reference": "best_recent"})
    controller = Controller(settings.model_copy(update={"promotion": best_recent}))
    evaluator.step()  # the starter's figures, for its task set
    tasks = registry.get("v0").metrics["heldout"]["task_set"]

    def scored(version: str, solved: int) -> None:
        registry.update_metrics(version, heldout={"evaluation": "coding", "task_set": tasks,
                                                  "solved": "1" * solved + "0" * (20 - solved),
                                                  "pass_rate": solved / 20})

    def promote(version: str) -> None:
        old = registry.stable().version
        registry.transition(version, "canary", "test", "gate passed")
        registry.transition(old, "superseded", "test", f"{version} promoted")
        registry.transition(version, "stable", "test", "non-inferior")

    scored("v0", 6)
    taught = candidate(settings, registry, starter_dir, "v0")
    scored(taught, 14)  # the rollouts taught 8 more tasks
    promote(taught)
    eroded = candidate(settings, registry, starter_dir, taught)
    scored(eroded, 10)  # 4 lost against it: p 1/16, not significant
    assert controller.skill_passed(registry.get(eroded), registry.stable())
    promote(eroded)
    further = candidate(settings, registry, starter_dir, eroded)
    scored(further, 6)  # 4 more lost: not significant against stable, nor below the starter
    assert against_stable.skill_references(registry.stable(), registry.get(further).metrics["heldout"]) == [
        ("v0", registry.get("v0").metrics["heldout"]), (eroded, registry.get(eroded).metrics["heldout"])]
    assert not controller.skill_passed(registry.get(further), registry.stable())
    skill = registry.get(further).metrics["skill"]
    assert skill["verdict"] == "held" and [c["reference"] for c in skill["comparisons"]] == ["v0", taught]
    assert [c["lost_skill"] for c in skill["comparisons"]] == [False, True]
    assert registry.history(further)[-1]["reason"].startswith(
        f"held for skill: coding: held-out pass rate 0.300 against {taught}'s 0.700 on the same 20 tasks (8 lost")
    assert registry.last_rewind().version == eroded  # back to stable, as after any hold


def test_after_a_hold_the_learner_goes_back_to_the_last_version_that_passed(guarded, starter_dir):
    """With `skill_rewind` last_passed, a canary that passed the skill guard and gave way
    undecided to its child: the child (or one trained on top of it) held for skill sends the
    learner back to that canary, not to stable, so what it learned of production is not
    trained again (a day of Nov 30: eight holds, each back to stable); a version without its
    weights any more, or the default (stable), sends it back to stable. The version it was
    put back on keeps its weights."""
    settings, registry, evaluator, to_stable = guarded
    last_passed = settings.promotion.model_copy(update={"skill_rewind": "last_passed"})
    controller = Controller(settings.model_copy(update={"promotion": last_passed}))
    evaluator.step()  # the starter's figures
    starter = registry.get("v0").metrics["heldout"]
    passed = candidate(settings, registry, starter_dir, "v0")
    registry.update_metrics(passed, heldout=starter)  # as good as stable
    assert controller.skill_passed(registry.get(passed), registry.stable())
    registry.transition(passed, "superseded", "test", "undecided after 67 completions; a newer one came")
    unscored = candidate(settings, registry, starter_dir, passed)  # given way to before its figures came
    lost = dict(starter, solved="0" * 20, pass_rate=0.0)

    def held_goes_back_to(guard: Controller) -> str:
        held = candidate(settings, registry, starter_dir, unscored)
        registry.update_metrics(held, heldout=lost)
        assert not guard.skill_passed(registry.get(held), registry.stable())
        assert registry.get(held).metrics["skill"]["verdict"] == "held"
        rewind = registry.last_rewind()
        assert rewind is not None and held in rewind.reason
        return rewind.version

    assert held_goes_back_to(controller) == passed
    assert registry.head().version == passed  # the learner continues from it
    assert passed in needs(settings, registry).protected
    assert held_goes_back_to(to_stable) == "v0"  # the default
    registry.drop_weights(passed, "retention, in this test")
    assert held_goes_back_to(controller) == "v0"


def test_no_evaluator_no_skill_evidence(tmp_path, starter_dir):
    """Without the evaluator running, the guard has no skill evidence and judges production only."""
    settings = Settings(data_dir=tmp_path, ports=PortsConfig(evaluator=free_port()),
                        rollouts=RolloutsConfig(heldout_every_s=60.0))
    registry = Registry(settings.policies_dir)
    staged = tmp_path / "staged"
    shutil.copytree(starter_dir, staged)
    stable = registry.publish(staged, parent=None, window=None, metrics={}, sample_ids=[], actor="test",
                              state="stable")
    assert Controller(settings).skill_passed(stable, stable)
