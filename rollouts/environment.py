"""What an environment is: tasks for the policy, and a score for each completion.

A product team registers its own by subclassing `Environment` (see docs/rollouts.md):

    class Haiku(Environment):
        name = "haiku"

        def tasks(self, split, rng):
            while True:
                yield Task(task_id=..., prompt="A haiku about the sea:\\n", level=1)

        def score(self, task, completion):
            return 1.0 if len(completion.splitlines()) == 3 else 0.0

and naming it in the settings (`rollouts.environment = "mypackage.haiku:Haiku"`).
A score is in [0, 1]; it is what the learner sees as the completion's `outcome`.
"""

from __future__ import annotations

import importlib
import random
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from liverl.settings import RolloutsConfig

Split = Literal["train", "heldout"]


@dataclass(frozen=True)
class Task:
    """One prompt to sample a group of completions for. `hidden` is what scores it (tests,
    expected answers): it stays with the rollout worker and never reaches the policy."""

    task_id: str
    prompt: str
    level: int = 1
    family: str = ""
    hidden: Any = field(default=None, repr=False, compare=False)
    stop: tuple[str, ...] = ()  # where a completion ends, for the replica's sampler
    reference: str | None = field(default=None, repr=False, compare=False)  # a known-good completion


class Environment(ABC):
    name: str = ""

    @abstractmethod
    def tasks(self, split: Split, rng: random.Random) -> Iterator[Task]:
        """Tasks of one split, in the order to attempt them; train and held-out share none."""

    @abstractmethod
    def score(self, task: Task, completion: str) -> float:
        """The completion's reward in [0, 1] (for code: the share of hidden tests passed)."""

    def scored_as(self, task: Task, completion: str) -> Hashable | None:
        """What `score` depends on, where that is only the completion's text (the program it
        makes): the worker scores completions of a group with the same one once. None (the
        default, for a score that varies or depends on more): each is scored."""
        return None

    def solved(self, task: Task, completion: str) -> bool:
        """Whether a completion counts towards the pass rate (every test passed)."""
        return self.score(task, completion) >= 1.0

    def heldout(self, count: int, seed: int = 0) -> list[Task]:
        """`count` distinct held-out tasks, the same ones for the same seed (the pass-rate set)."""
        return self.distinct("heldout", count, seed)

    def distinct(self, split: Split, count: int, seed: int = 0) -> list[Task]:
        """`count` distinct tasks of `split`, the same ones for the same seed."""
        tasks: dict[str, Task] = {}
        stream = self.tasks(split, random.Random(seed))
        for _ in range(count * 50):
            task = next(stream, None)
            if task is None:
                break
            tasks.setdefault(task.task_id, task)
            if len(tasks) == count:
                return list(tasks.values())
        raise ValueError(f"{self.name or type(self).__name__} environment: fewer than {count} distinct "
                         f"{split} tasks (at these levels)")


class MultiTurnEnvironment(Environment):
    """A task worked through over several turns. After each of the policy's turns (an
    attempt, a tool call), `respond` gives what the policy reads next (the tool's output)
    or None when the episode is over; `score` then scores the last turn. When the context
    would overflow, the policy is asked to summarise (`summary_request`), and a fresh
    context starts from `resume` around that summary (rollouts/episode.py)."""

    max_turns: int = 4
    summary_request: str = "\nSummarise what you know so far:"  # appended; the policy writes the summary

    @abstractmethod
    def respond(self, task: Task, turns: list[str]) -> str | None:
        """What the policy reads after its turns so far (`turns`, its own texts in order), or
        None when the task is done (solved, or given up)."""

    def resume(self, task: Task) -> tuple[str, str]:
        """A fresh context after a summary: (text before the summary, text after it)."""
        return task.prompt + "\nWhat you knew before:", "\n"


def configured_environment(config: RolloutsConfig) -> Environment:
    """The environment the settings name (the coding ones at `levels`, named from `train_params`)."""
    coding = config.environment in ("coding", "coding-feedback")
    kwargs = {"levels": config.levels, "train_params": config.train_params} if coding else {}
    return load_environment(config.environment, **kwargs)


def load_environment(spec: str, **kwargs: Any) -> Environment:
    """An environment by its 'module:Class' path (a built-in one by its name alone)."""
    if ":" not in spec:
        spec = BUILT_IN.get(spec, spec)
    module_name, _, class_name = spec.partition(":")
    if not class_name:
        raise ValueError(f"environment {spec!r}: expected a built-in name ({', '.join(BUILT_IN)}) "
                         "or 'module:Class'")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {spec!r}: {class_name} is not an Environment subclass")
    return cls(**kwargs)


BUILT_IN = {"coding": "rollouts.coding:CodingEnvironment", "humaneval": "rollouts.coding:HumanEvalEnvironment",
            "coding-feedback": "rollouts.coding:CodingWithFeedback"}
