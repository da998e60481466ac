"""Rollout groups the learner samples itself (`learner.own_groups`): on-policy teaching between troughs.

Replicas are lent to rollouts only in traffic troughs, so between them the day's versions train on
production feedback and on groups replayed from older versions, and the skill drains a little at
each of them (docs/learning.md, "Skills that hold"). Groups sampled from each version's own parent
are what taught on the harness (`benchmarks/bench_night.py`: held-out 0.203 after eight versions,
against 0.040 from the starter's samples). So with `learner.own_groups = N`, each version with
production samples also trains N groups the learner samples itself, from its parent's weights (the
trainer's fp32 model: no replica, no sampler mismatch, the behaviour logprobs exact), on tasks of
the training split, each scored by the configured environment as the rollout worker scores it.
They are the learner's input, not the stream's: not published, not recorded as learned (the
version's metrics count them: `own_samples`, and their mean reward, `own_reward`).
"""

from __future__ import annotations

import random
import time

import torch

from learner.mix import as_if_sampled_now
from learner.trainer import Trainer
from liverl.contracts import RewardedSample, SamplingParams, Trajectory
from liverl.settings import LearnerConfig, RolloutsConfig
from rollouts.environment import Environment, MultiTurnEnvironment, Task, configured_environment

REWARD_FN = "own-groups"


class OwnGroups:
    """The learner's own sampler: `groups` tasks a version, `group_size` completions each."""

    def __init__(self, environment: Environment, groups: int, rollouts: RolloutsConfig, seed: int = 11):
        self.environment, self.groups, self.config, self.seed = environment, groups, rollouts, seed
        self.seconds = 0.0  # what the last draw took, sampling and scoring: its cost to the learner's pace

    @classmethod
    def configured(cls, learner: LearnerConfig, rollouts: RolloutsConfig) -> OwnGroups | None:
        """The sampler the settings ask for, on the configured environment; None when off."""
        if not learner.own_groups:
            return None
        environment = configured_environment(rollouts)
        if isinstance(environment, MultiTurnEnvironment):
            raise ValueError(f"LIVERL_LEARNER__OWN_GROUPS samples one turn a completion, and rollouts.environment "
                             f"{rollouts.environment!r} is played over several: set it to 0, or use a one-turn "
                             f"environment")
        return cls(environment, learner.own_groups, rollouts)

    def version_seed(self, seq: int) -> int:
        """The seed of version `seq`'s draw: one of its own for every version number."""
        return self.seed * 1_000_003 + seq

    def tasks(self, seq: int) -> list[Task]:
        """Version `seq`'s tasks (the number it will be published under): a function of it, as its
        sampling is, so that a version stays a function of its parent and its inputs (after a
        restart too), and each version trained from one parent after a rewind draws its own."""
        draw = self.environment.tasks("train", random.Random(self.version_seed(seq)))
        return [next(draw) for _ in range(self.groups)]

    def sample(self, trainer: Trainer, parent: str, seq: int) -> list[RewardedSample]:
        """Version `seq`'s groups, sampled from the weights `trainer` holds now (`parent`'s)."""
        model, tokenizer, started = trainer.model, trainer.tokenizer, time.perf_counter()
        was_training = model.training
        model.eval()
        samples: list[RewardedSample] = []
        try:
            with torch.no_grad(), torch.random.fork_rng():
                torch.manual_seed(self.version_seed(seq))
                for index, task in enumerate(self.tasks(seq)):
                    samples += self.group(model, tokenizer, task, parent, f"{seq}-{index}")
        finally:
            model.train(was_training)
        samples = as_if_sampled_now(trainer, samples)  # the behaviour logprobs: the parent's own
        self.seconds = time.perf_counter() - started
        return samples

    def group(self, model, tokenizer, task: Task, parent: str, name: str) -> list[RewardedSample]:
        """One task's `group_size` completions at the rollout temperature, each with its score
        (completions that make the same program are scored once, as the worker does)."""
        prompt = tokenizer(task.prompt, return_tensors="pt").input_ids
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                             temperature=self.config.temperature, top_p=None, top_k=None,
                             max_new_tokens=self.config.max_tokens, num_return_sequences=self.config.group_size,
                             pad_token_id=tokenizer.pad_token_id, stop_strings=list(task.stop) or None,
                             tokenizer=tokenizer)
        scored: dict[object, float] = {}
        members = []
        for row, written in enumerate(out[:, prompt.shape[1]:].tolist()):
            ids = written_ids(written, tokenizer, task.stop)
            text = until_stop(tokenizer.decode(ids, skip_special_tokens=True), task.stop)
            key = self.environment.scored_as(task, text)
            score = scored[key] if key is not None and key in scored else self.environment.score(task, text)
            if key is not None:
                scored[key] = score
            completion_id = f"own-{name}-{row}"
            trajectory = Trajectory(
                event_id=completion_id, tenant=self.config.tenant, completion_id=completion_id,
                group_id=f"own-{name}", group_size=self.config.group_size, policy_version=parent, source="rollout",
                prompt_text=task.prompt, completion_text=text, prompt_token_ids=prompt[0].tolist(),
                completion_token_ids=ids, completion_logprobs=[0.0] * len(ids),  # replaced: as_if_sampled_now
                sampling=SamplingParams(temperature=self.config.temperature, max_tokens=self.config.max_tokens))
            members.append(RewardedSample(
                sample_id=f"{self.config.tenant}:{completion_id}", event_id=f"{self.config.tenant}:{completion_id}",
                tenant=self.config.tenant, reward=score, reward_source="feedback", reward_fn_version=REWARD_FN,
                trajectory=trajectory))
        return members


def written_ids(row: list[int], tokenizer, stop: tuple[str, ...]) -> list[int]:
    """The tokens a completion wrote, as a replica reports them: through the token that completed
    a stop string, or through its end-of-sequence token. The padding after either is not written
    (it may be the end-of-sequence id itself, so the text tells the two apart)."""
    ends = (tokenizer.eos_token_id, tokenizer.pad_token_id)
    for end in range(1, len(row) + 1):
        if any(s in tokenizer.decode(row[:end], skip_special_tokens=True) for s in stop):
            return row[:end]
        if row[end - 1] in ends:
            return row[:end] if row[end - 1] == tokenizer.eos_token_id else row[:end - 1]
    return row


def until_stop(text: str, stop: tuple[str, ...]) -> str:
    """The completion's text before its first stop string, as a replica returns it."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]
