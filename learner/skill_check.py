"""The learner's own look at the skill before it publishes a version (`learner.skill_check_tasks`).

The skill guard holds a candidate that solves significantly fewer held-out tasks than stable, and
the learner then rewinds: in the day runs of Nov 30 most holds were of the first version trained
after stable, a single small step of production's learning (0.003-0.07 nats a token) that took more
than 5 points of the skill, and each hold threw production's progress away. Sixteen passed
completions' likelihood (`max_skill_anchor_drop`) is a weak stand-in for tasks solved greedily. So
the learner solves check tasks itself, greedily, as the evaluator does, on tasks of the *training*
split (the held-out ones stay the guard's: a version chosen on them would be judged on what chose
it), and a version that solves more than `skill_check_margin` fewer of them than stable (or fewer
than its parent, where that is lower) is trained again at half the lr (`learner/rl.py: backtracked`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from liverl.settings import LearnerConfig, RolloutsConfig
from rollouts.environment import Environment, configured_environment
from rollouts.evaluate import greedy_first_lines, greedy_solved, lines_solved

CHECK_SEED = 7  # another draw of the training split than the rollout worker's first tasks


class SkillCheck:
    """Check tasks of the training split, each version's solved list, and the floor a version
    is held to."""

    def __init__(self, environment: Environment, tasks: int, margin: float, max_tokens: int):
        self.environment = environment
        self.tasks = environment.distinct("train", tasks, seed=CHECK_SEED)
        self.margin = margin
        self.max_tokens = max_tokens
        self.known: dict[tuple[str, str], bool] = {}  # (task, first line) -> solved: the sandbox runs once
        self.by_version: dict[str, list[bool]] = {}
        self.last: list[bool] = []  # the newest weights checked (`solve`)

    @classmethod
    def configured(cls, learner: LearnerConfig, rollouts: RolloutsConfig) -> SkillCheck | None:
        """The check the settings ask for, on the configured environment; None when off."""
        if not learner.skill_check_tasks:
            return None
        return cls(configured_environment(rollouts), learner.skill_check_tasks, learner.skill_check_margin,
                   rollouts.max_tokens)

    def solve(self, model: torch.nn.Module, tokenizer) -> float:
        """The share of check tasks the weights in `model` solve greedily now (kept in `last`): the
        trainer's fp32 weights, where the evaluator scores the bf16 export (a near-tie between two
        tokens may go the other way there)."""
        side, was_training = tokenizer.padding_side, model.training
        model.eval()
        try:
            with torch.no_grad():
                lines = greedy_first_lines(model, tokenizer, self.tasks, self.max_tokens)
        finally:
            tokenizer.padding_side = side
            model.train(was_training)
        self.last = lines_solved(self.environment, self.tasks, lines, self.known)
        return sum(self.last) / len(self.tasks)

    def of(self, version: str, model_dir: str) -> float:
        """A version's share, from the learner's own check when it trained it, else from its weights."""
        if version not in self.by_version:
            self.by_version[version] = greedy_solved(Path(model_dir), self.environment, self.tasks,
                                                     self.max_tokens, known=self.known)
        return sum(self.by_version[version]) / len(self.tasks)

    def floor(self, parent: tuple[str, str], stable: tuple[str, str]) -> float:
        """The least share a version of `parent` may solve ((version, model_dir) each): stable's,
        what the guard compares with, less the margin, so that the steps since stable lose no more
        than the margin together (a floor under the parent's alone lets each of them lose it
        again: on bench_mix, eight points over thirty versions, each within two of its parent);
        a parent already under that, its own share, so that it is not asked for what no smaller
        step gives, and loses no more."""
        return min(self.of(*stable) - self.margin, self.of(*parent))

    def remember(self, version: str) -> None:
        """The newest weights checked are now `version`'s."""
        self.by_version[version] = self.last
