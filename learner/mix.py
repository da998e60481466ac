"""How a version mixes production samples with rollout groups beyond the fresh ones: a
replay of rollout groups already trained.

Replicas are lent to rollouts only in traffic troughs, so fresh groups come in bursts and a
day's versions in between train on production feedback alone, which takes the skill the
rollouts taught away (the day demo drained the coding held-out pass rate from 22% to 0%:
issue 46). Each version with production samples trains `learner.replay_groups` groups
again, less the fresh ones it takes: an anchor to what rollouts taught, on the tasks they
taught it (docs/learning.md, "Training for both", has the ablation that chose it). The
replayed groups' behaviour logprobs are older than any fresh sample's; the truncated
importance weight and the trust region around the parent bound what they can do.
Replayed samples are not learned again in the registry's record (exactly once): they are
counted in the version's metrics (`replayed_samples`).

The skill anchor (`learner.skill_anchor_coef`) holds, at each version's step, the parent's
likelihood of rollout completions that passed, drawn from the same buffer: a constraint on
what production may take, not a second lesson (`learner/rl.py: skill_anchor_loss`).

Once production is learned (its samples' mean reward at `learner.settled_reward`), a
version of production alone takes a smaller step (`settled_step`): the day's skill was lost
a little at every such version, not at a few large ones (docs/benchmarks.md, the day).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable

import torch

from learner.trainer import Trainer, collate, token_logprobs
from liverl.contracts import RewardedSample


class ReplayBuffer:
    """The most recent `size` rollout groups trained, each as its members."""

    def __init__(self, size: int):
        self.groups: deque[list[RewardedSample]] = deque(maxlen=size)

    def remember(self, groups: Iterable[list[RewardedSample]]) -> None:
        self.groups.extend(list(g) for g in groups if g)

    def take(self, count: int) -> list[RewardedSample]:
        """`count` groups, round robin (the least recently replayed first), flattened."""
        taken: list[RewardedSample] = []
        for _ in range(min(count, len(self.groups))):
            group = self.groups.popleft()
            self.groups.append(group)
            taken += group
        return taken

    def passed(self, count: int, seed: int) -> list[RewardedSample]:
        """Up to `count` members that did better than their group (the completions the skill
        anchor holds: `learner/rl.py: skill_anchor_loss`), a different draw for each seed."""
        better = [s for group in self.groups for s in group
                  if s.reward > sum(m.reward for m in group) / len(group)]
        return random.Random(seed).sample(better, min(count, len(better)))


def settled_step(production_rewards: list[float], fresh_groups: int, settled_reward: float | None,
                 scale: float) -> float:
    """The share of the lr this version steps: `scale` when it trains no fresh rollout group
    and its production samples' mean reward has reached `settled_reward` (what is left to
    learn there is small, and each full step there takes some of the skill away), else 1."""
    if settled_reward is None or fresh_groups or not production_rewards:
        return 1.0
    return scale if sum(production_rewards) / len(production_rewards) >= settled_reward else 1.0


def held_step(rewinds: int, scale: float | None, floor: float) -> float:
    """The share of the lr a version steps when the guard has put the learner back `rewinds`
    times since stable was promoted (candidates held for skill or aborted): `scale` per rewind,
    down to `floor`, and 1 once a candidate is promoted (a new stable has none). Each held
    candidate was a step too far for something the guard checks, so the next ones try a
    smaller one, as TRPO's line search halves a step that broke its constraint."""
    if scale is None or not rewinds:
        return 1.0
    return max(scale ** rewinds, floor)


def as_if_sampled_now(trainer: Trainer, samples: list[RewardedSample]) -> list[RewardedSample]:
    """`samples` with their behaviour logprobs from the weights about to train (the version's
    parent), so each one's importance weight is 1. With the behaviour of the night, the
    truncated weight pi/mu shrinks exactly where the policy has forgotten (mu there is
    high, pi low), and a replay pulls least where it is needed most (docs/learning.md).
    Single-turn samples on one rank only (a multi-turn one keeps its own, and under FSDP a
    forward is every rank's step)."""
    if trainer.world != 1:
        return samples
    out = []
    trainer.model.eval()
    with torch.no_grad():
        for sample in samples:
            if sample.trajectory.multi_turn():
                out.append(sample)
                continue
            batch = collate([sample], trainer.tokenizer.pad_token_id, trainer.layers, trainer.top_k)
            written = token_logprobs(trainer.model, batch)[batch.completion_mask.bool()].tolist()
            trajectory = sample.trajectory.model_copy(update={"completion_logprobs": written})
            out.append(sample.model_copy(update={"trajectory": trajectory}))
    return out
