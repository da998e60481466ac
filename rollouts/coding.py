"""Python coding with hidden unit tests: generated task families, and HumanEval-style files.

A generated task is a function header and docstring ending in `return`; the policy
writes the expression (one line). Families come in graded levels:

    1  return a parameter unchanged           (the starter copies it in 42% of samples)
    2  a parameter and a constant: p + k, p * k, p - k
    3  two parameters: a + b, max(a, b), min(a, b), a * b
    4  a builtin or method on one parameter: len(p), sum(p), p.upper(), p[::-1], sorted(p)
    5  two steps: p * k + j, a count of items equal to k, the larger of p and k

so GRPO gets signal from level 1 at once, and each level asks one more idea. Every task
is checked on several inputs, so no constant answer passes, and its parameter names
vary, so no memorised answer does. Held-out tasks are surface variants of the same
families: their function names, parameter names and constants come from pools the
training split never uses, so the two splits share no task.
"""

from __future__ import annotations

import ast
import builtins
import gzip
import json
import keyword
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liverl.task_pools import CONSTANTS, NAMES, PARAMS
from rollouts.environment import Environment, MultiTurnEnvironment, Split, Task
from rollouts.sandbox import Case, SandboxLimits, cases_from_asserts, run_tests


@dataclass(frozen=True)
class Family:
    """One kind of task: its docstring, the reference answer, and its inputs."""

    name: str
    level: int
    params: int
    doc: str  # {a}, {b}: parameter names; {k}, {j}: constants
    reference: Callable[..., Any]  # (k, j, *args) -> expected
    inputs: str  # "int", "str" or "list": what each argument is
    answer: str  # a correct expression, same placeholders as `doc`


def ints(rng: random.Random) -> int:
    return rng.randint(-50, 50)


def strings(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefxyz") for _ in range(rng.randint(1, 8)))


def lists(rng: random.Random) -> list[int]:
    return [rng.randint(0, 12) for _ in range(rng.randint(0, 8))]


INPUTS = {"int": ints, "str": strings, "list": lists}

FAMILIES = [
    Family("identity", 1, 1, "Return {a} unchanged.", lambda k, j, a: a, "int", "{a}"),
    Family("identity_text", 1, 1, "Return {a} as it is.", lambda k, j, a: a, "str", "{a}"),
    Family("add_constant", 2, 1, "Return {a} plus {k}.", lambda k, j, a: a + k, "int", "{a} + {k}"),
    Family("multiply_constant", 2, 1, "Return {a} times {k}.", lambda k, j, a: a * k, "int", "{a} * {k}"),
    Family("subtract_constant", 2, 1, "Return {a} minus {k}.", lambda k, j, a: a - k, "int", "{a} - {k}"),
    Family("add", 3, 2, "Return {a} plus {b}.", lambda k, j, a, b: a + b, "int", "{a} + {b}"),
    Family("larger", 3, 2, "Return the larger of {a} and {b}.", lambda k, j, a, b: max(a, b), "int", "max({a}, {b})"),
    Family("smaller", 3, 2, "Return the smaller of {a} and {b}.", lambda k, j, a, b: min(a, b), "int", "min({a}, {b})"),
    Family("multiply", 3, 2, "Return {a} times {b}.", lambda k, j, a, b: a * b, "int", "{a} * {b}"),
    Family("length", 4, 1, "Return the length of {a}.", lambda k, j, a: len(a), "str", "len({a})"),
    Family("total", 4, 1, "Return the sum of the numbers in {a}.", lambda k, j, a: sum(a), "list", "sum({a})"),
    Family("upper", 4, 1, "Return {a} in upper case.", lambda k, j, a: a.upper(), "str", "{a}.upper()"),
    Family("reversed", 4, 1, "Return {a} reversed.", lambda k, j, a: a[::-1], "str", "{a}[::-1]"),
    Family("sorted", 4, 1, "Return the numbers in {a} in increasing order.", lambda k, j, a: sorted(a), "list",
           "sorted({a})"),
    Family("affine", 5, 1, "Return {a} times {k} plus {j}.", lambda k, j, a: a * k + j, "int", "{a} * {k} + {j}"),
    Family("count", 5, 1, "Return how many numbers in {a} equal {k}.", lambda k, j, a: a.count(k), "list",
           "{a}.count({k})"),
    Family("at_least", 5, 1, "Return the larger of {a} and {k}.", lambda k, j, a: max(a, k), "int", "max({a}, {k})"),
]
LEVELS = sorted({f.level for f in FAMILIES})
CASES = 5  # inputs per task: enough that a lucky constant never passes

# Parameter names a wide training split adds to its twelve: identifiers as code names them,
# one token or several, none of them a held-out name, a keyword or a builtin. Twelve names of
# one token teach a policy to favour them and to stop after a name's first token; with these,
# a policy that already copies some names of several tokens learns to copy the name it reads
# (docs/history.md, "A starter that copies names of several tokens, and wide training names").
_WIDE = """amount total price index offset limit width height length depth score level weight speed
rate delta step start end low high first last prev current target label title message content
body header status code flag state config options params query url host port user email record
row column cell table batch chunk block frame image pixel color point vector matrix number digit
letter char prefix suffix pattern answer response request payload context session event timer
timeout delay retries attempt page slot bucket queue stack tree graph edge vertex leaf root
parent child owner group member sign op output os file read opt list_id user_id file_name
max_size min_value new_value old_value input_text raw_data item_count base factor ratio bias
margin radius angle distance duration interval budget quota balance cost fee tax discount
counter tally sample reading signal level_id city country region zone channel topic tag
version revision build_id seed salt nonce cursor marker anchor window span range_start
message_id order_id customer account wallet device sensor port_number temperature pressure"""
WIDE_PARAMS = sorted(set(_WIDE.split()) - set(PARAMS["heldout"]) - set(NAMES["heldout"])
                     - set(keyword.kwlist) - set(dir(builtins)))
TRAIN_PARAMS = {"split": PARAMS["train"], "wide": sorted(set(PARAMS["train"]) | set(WIDE_PARAMS))}


def make_task(family: Family, split: Split, rng: random.Random, train_params: str = "split") -> Task:
    """One task of `family` with names and constants from `split`'s pools (a training task's
    parameters from TRAIN_PARAMS[train_params])."""
    fname = rng.choice(NAMES[split])
    a, b = rng.sample(TRAIN_PARAMS[train_params] if split == "train" else PARAMS[split], 2)
    k, j = rng.sample(CONSTANTS[split], 2)
    names = [a, b][: family.params]
    doc = family.doc.format(a=a, b=b, k=k, j=j)
    prompt = f'def {fname}({", ".join(names)}):\n    """{doc}"""\n    return'
    draw = INPUTS[family.inputs]
    cases: list[Case] = []
    for attempt in range(100 * CASES):
        args = tuple(draw(rng) for _ in names)
        expected = family.reference(k, j, *args)
        # Distinct expected values where the family has them, so a constant passes one case.
        if attempt >= 50 * CASES or all(expected != seen.expected for seen in cases):
            cases.append(Case(f"{fname}({', '.join(map(repr, args))})", expected))
        if len(cases) == CASES:
            break
    # The task's id names everything that makes it this task, so equal ids are equal tasks.
    task_id = f"{split}:{family.name}:{fname}:{','.join(names)}:{k}:{j}"
    return Task(task_id=task_id, prompt=prompt, level=family.level, family=family.name,
                hidden=tuple(cases), stop=("\n",), reference=" " + family.answer.format(a=a, b=b, k=k, j=j))


def solution_source(task: Task, completion: str) -> str:
    """The program a completion makes: the prompt, then its first line."""
    return task.prompt + completion.split("\n", 1)[0] + "\n"


class CodingEnvironment(Environment):
    """Generated Python functions of graded difficulty, scored in the sandbox."""

    name = "coding"

    def __init__(self, levels: list[int] | None = None, limits: SandboxLimits | None = None,
                 train_params: str = "split"):
        unknown = set(levels or []) - set(LEVELS)
        if unknown:
            raise ValueError(f"coding environment: no level {sorted(unknown)} (levels are {LEVELS})")
        if train_params not in TRAIN_PARAMS:
            raise ValueError(f"coding environment: no training names {train_params!r} (one of {list(TRAIN_PARAMS)})")
        self.families = [f for f in FAMILIES if levels is None or f.level in levels]
        self.limits = limits or SandboxLimits()
        self.train_params = train_params

    def tasks(self, split: Split, rng: random.Random) -> Iterator[Task]:
        while True:
            yield make_task(rng.choice(self.families), split, rng, self.train_params)

    def score(self, task: Task, completion: str) -> float:
        return run_tests(self.scored_as(task, completion), task.hidden, self.limits).score

    def scored_as(self, task: Task, completion: str) -> str:
        return solution_source(task, completion)  # the program the sandbox runs


class CodingWithFeedback(CodingEnvironment, MultiTurnEnvironment):
    """The generated tasks over several turns, with a test-running tool: after each
    attempt the policy reads how many hidden tests it passed (a comment under its code,
    never the expected values) and writes the expression again, until every test passes
    or `max_turns` attempts are spent. The score is the last attempt's."""

    name = "coding-feedback"
    summary_request = "\n    # notes so far:"

    def __init__(self, levels: list[int] | None = None, limits: SandboxLimits | None = None, max_turns: int = 4,
                 train_params: str = "split"):
        super().__init__(levels, limits, train_params)
        self.max_turns = max_turns

    def respond(self, task: Task, turns: list[str]) -> str | None:
        verdict = run_tests(solution_source(task, turns[-1]), task.hidden, self.limits)
        if verdict.passed == verdict.total or len(turns) >= self.max_turns:
            return None
        return f"\n    # run_tests: {verdict.passed} of {verdict.total} passed\n    return"

    def resume(self, task: Task) -> tuple[str, str]:
        header = task.prompt.removesuffix("    return")
        return header + "    # notes:", "\n    return"


class HumanEvalEnvironment(Environment):
    """Tasks from a HumanEval-style JSONL file (`task_id`, `prompt`, `entry_point`, and
    `test` defining `check(candidate)`), for real models. Each `assert candidate(...) ==
    VALUE` in `check` becomes a hidden case; a problem with other kinds of checks (loops,
    tolerances) is left out and counted in `skipped`, since the sandbox compares values
    outside the completion's process and cannot run the check's own code there. These
    files are benchmarks: both splits give the same tasks."""

    name = "humaneval"

    def __init__(self, path: str | Path, limits: SandboxLimits | None = None):
        self.limits = limits or SandboxLimits()
        self.tasks_by_id: dict[str, Task] = {}
        self.skipped: dict[str, str] = {}
        path = Path(path)
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            problem = json.loads(line)
            missing = {"task_id", "prompt", "entry_point", "test"} - set(problem)
            if missing:
                raise ValueError(f"{path}: line {number} lacks {sorted(missing)}")
            try:
                cases = humaneval_cases(problem["test"], problem["entry_point"])
            except (ValueError, SyntaxError, TypeError) as error:  # TypeError: a value no test compares
                self.skipped[problem["task_id"]] = str(error)
                continue
            self.tasks_by_id[problem["task_id"]] = Task(
                task_id=problem["task_id"], prompt=problem["prompt"], family="humaneval", hidden=cases,
                stop=("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"),
                reference=problem.get("canonical_solution"))
        if not self.tasks_by_id:
            raise ValueError(f"{path}: no problem with `assert candidate(...) == VALUE` checks")

    def tasks(self, split: Split, rng: random.Random) -> Iterator[Task]:
        order = list(self.tasks_by_id.values())
        while True:
            rng.shuffle(order)
            yield from order

    def score(self, task: Task, completion: str) -> float:
        return run_tests(self.scored_as(task, completion), task.hidden, self.limits).score

    def scored_as(self, task: Task, completion: str) -> str:
        return task.prompt + completion  # the program the sandbox runs


def humaneval_cases(test: str, entry_point: str) -> list[Case]:
    """The `assert candidate(...) == VALUE` lines of a HumanEval `check`, calling `entry_point`."""
    check = next((node for node in ast.parse(test).body
                  if isinstance(node, ast.FunctionDef) and node.name == "check"), None)
    if check is None or not check.args.args:
        raise ValueError("no check(candidate) function")
    candidate = check.args.args[0].arg
    asserts = []
    for statement in check.body:
        if isinstance(statement, ast.Assert) and isinstance(statement.test, ast.Constant):
            continue  # HumanEval's `assert True` filler
        if not isinstance(statement, ast.Assert):
            raise ValueError(f"not an assert: {ast.unparse(statement)[:80]}")
        for node in ast.walk(statement.test):
            if isinstance(node, ast.Name) and node.id == candidate:
                node.id = entry_point
        asserts.append(ast.unparse(statement))
    return cases_from_asserts("\n".join(asserts))
