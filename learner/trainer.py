"""One policy being trained: fp32 master weights, Adam state, and a step on a batch.

Published versions are the bf16 rounding of the master weights (what GPUs serve), so
consecutive versions differ only where a bf16 value actually changed.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from learner import router_replay
from learner.logprobs import causal_lm, chunked_token_logprobs
from learner.modes import (
    adapted_weights,
    available_memory,
    freeze,
    lora_params,
    published_state,
    published_view,
    too_big,
    with_adapters,
)
from learner.rl import (
    RunningBaseline,
    adapted_lr,
    advantage_stats,
    backtracked,
    entropy_bonus,
    group_advantages,
    policy_gradient_loss,
    policy_shift,
    skill_anchor_loss,
    version_minibatches,
    warmup_share,
)
from learner.segments import segments, turns_problem, written_tokens
from learner.sharding import gathered, like, rank_and_world, resharded
from liverl.contracts import Architecture, RewardedSample, misfit
from liverl.probe import PROBE_FILE, probe_logprobs
from liverl.settings import LearnerConfig, LoraConfig

if TYPE_CHECKING:
    from learner.skill_check import SkillCheck


@dataclass
class Batch:
    input_ids: torch.Tensor        # [R, T]: one row per segment (learner/segments.py)
    attention: torch.Tensor        # [R, T]
    completion_mask: torch.Tensor  # [R, T-1]: targets the policy wrote (in the loss)
    behaviour_logp: torch.Tensor   # [R, T-1]
    routing: torch.Tensor | None   # [layers, R*T, k], -1 where not recorded
    sample_of_row: torch.Tensor    # [R]: which of the collated samples each row is a segment of


def collate(samples: list[RewardedSample], pad_id: int, layers: int, top_k: int) -> Batch:
    rows = [(i, seg) for i, s in enumerate(samples) for seg in segments(s.trajectory)]
    T = max(len(seg.token_ids) for _, seg in rows)
    R = len(rows)
    input_ids = torch.full((R, T), pad_id, dtype=torch.long)
    attention = torch.zeros((R, T), dtype=torch.long)
    mask = torch.zeros((R, T - 1))
    behaviour = torch.zeros((R, T - 1))
    routing = None
    if any(seg.routed_experts is not None for _, seg in rows):
        routing = torch.full((layers, R, T, top_k), -1, dtype=torch.long)
    for r, (_, seg) in enumerate(rows):
        n = len(seg.token_ids)
        input_ids[r, :n] = torch.tensor(seg.token_ids)
        attention[r, :n] = 1
        # Target position j predicts token j+1.
        mask[r, : n - 1] = torch.tensor(seg.written[1:], dtype=torch.float32)
        behaviour[r, : n - 1] = torch.tensor(seg.behaviour_logprobs[1:])
        if routing is not None and seg.routed_experts is not None:
            recorded = torch.from_numpy(seg.routed_experts.astype("int64"))  # [tokens, layers, k]
            routing[:, r, : recorded.shape[0]] = recorded.permute(1, 0, 2)
    return Batch(input_ids, attention, mask, behaviour,
                 None if routing is None else routing.reshape(layers, R * T, top_k),
                 torch.tensor([i for i, _ in rows]))


def vocabulary_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """log pi(. | x_<=j) over the vocabulary at every position, [B, T-1, V]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1)


def token_logprobs(model: torch.nn.Module, batch: Batch, weights: dict[str, torch.Tensor] | None = None,
                   whole_vocabulary: bool = False) -> torch.Tensor:
    """log pi(x_{j+1} | x_<=j) for every position, [B, T-1]; `weights` (by parameter name)
    in place of the model's own. The vocabulary's logits are made a chunk of positions at a
    time (learner/logprobs.py), or all at once with `whole_vocabulary` (for an entropy term:
    every logprob the step compares then comes from the same computation, so equal weights
    give equal numbers). Under FSDP the whole model's forward runs (its hooks gather the
    sharded embeddings and output layer), so the logits are made at once there too."""
    with swapped_in(model, weights):
        if whole_vocabulary or rank_and_world()[1] > 1:
            return vocabulary_logprobs(model, batch).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        return chunked_token_logprobs(model, batch.input_ids, batch.attention)


@contextmanager
def swapped_in(model: torch.nn.Module, weights: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """The model computing with `weights` (by its parameter names) instead of its own inside
    the block, no gradient through them. Alone, each parameter points at its stand-in and
    back (no copy of the weights at every step); under FSDP they are copied into the shards
    and the originals back after, as FSDP gathers each forward's weights from the shards it
    keeps (neither a pointer nor torch.func.functional_call would reach them)."""
    if not weights:
        yield
        return
    resharded(model)  # the shards, not what a forward left gathered
    parameters = dict(model.named_parameters())
    if rank_and_world()[1] == 1:
        own = {name: parameters[name].data for name in weights}
        for name, weight in weights.items():
            parameters[name].data = weight
        try:
            yield
        finally:
            for name, tensor in own.items():
                parameters[name].data = tensor
        return
    with torch.no_grad():
        copies = {name: parameters[name].detach().clone() for name in weights}
        for name, weight in weights.items():
            parameters[name].copy_(weight)
    try:
        yield
    finally:
        resharded(model)
        with torch.no_grad():
            for name, weight in copies.items():
                parameters[name].copy_(weight)


def problem(sample: RewardedSample, arch: Architecture) -> str | None:
    """Why a sample cannot be trained on, or None: nothing malformed reaches a gradient."""
    t = sample.trajectory
    if t.multi_turn():
        return turns_problem(t, arch)
    if not t.prompt_token_ids or not t.completion_token_ids:
        if t.turns and any(turn.token_ids for turn in t.turns):
            return "no prompt or completion token ids, and not every turn has the token ids it had in context"
        return "no prompt or completion token ids"
    if len(t.completion_logprobs) != len(t.completion_token_ids):
        return "behaviour logprobs do not match the completion tokens"
    if not all(x <= 0 for x in t.completion_logprobs):
        return "behaviour logprobs must be at most 0"
    if bad := misfit(t, arch):
        return f"{bad[0]}: {bad[1]}"
    return None


def refuse_what_cannot_fit(model_dir: Path, config: LearnerConfig) -> None:
    """Refuse, before loading anything, a mode whose fp32 weights, gradients and Adam state
    exceed the memory left, naming what would fit. The ranks of one host share its memory:
    FSDP splits the footprint between them, it does not shrink it."""
    with torch.device("meta"):
        shape = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    lora = config.lora or LoraConfig()
    trained = (lora_params(shape, lora.rank, lora.targets, lora.router) if config.lora else
               sum(p.numel() for n, p in shape.named_parameters()
                   if not any(part in n for part in config.frozen_parameters)))
    if why := too_big(shape, trained, available_memory(), lora):
        raise ValueError(why)


@dataclass
class StepStats:
    """What one gradient step measured."""

    objective: dict[str, float] = field(default_factory=dict)  # loss, mean_is_weight, clipped_fraction
    grad_norm: float | None = None
    logprob_gap: torch.Tensor | None = None  # |learner - behaviour| per written token (first epoch)
    routed: int = 0                          # tokens whose served experts were recorded
    recomputed_mismatch: float = 0.0         # share of them the learner's own top-k routes elsewhere
    replayed_mismatch: float = 0.0           # share the training pass routed elsewhere (0 with replay)


def summarise(steps: list[StepStats], router_replay_on: bool) -> dict:
    """A version's metrics from its steps' (means over steps, token-weighted mismatches)."""
    gaps = [s.logprob_gap for s in steps if s.logprob_gap is not None]
    gap = torch.cat(gaps) if gaps else torch.zeros(1)
    routed = sum(s.routed for s in steps)
    objective = {k: sum(s.objective[k] for s in steps) / len(steps) for k in (steps[0].objective if steps else {})}
    grad_norms = [s.grad_norm for s in steps if s.grad_norm is not None]  # step() sets every one
    return {
        "tokens": int(gap.numel()),
        **objective,
        **({"grad_norm": sum(grad_norms) / len(grad_norms)} if grad_norms else {}),
        "grad_norm_max": max(grad_norms, default=None),
        "logprob_mismatch_mean": gap.mean().item(),
        "logprob_mismatch_max": gap.max().item(),
        # Recomputed top-k vs served (what training would use without replay)...
        "routing_mismatch_fraction": (sum(s.recomputed_mismatch * s.routed for s in steps) / routed
                                      if routed else None),
        # ...and the experts the training pass actually ran vs served (0 with replay).
        "trained_routing_mismatch_fraction": (sum(s.replayed_mismatch * s.routed for s in steps) / routed
                                              if routed else None),
        "router_replay": bool(routed) and router_replay_on,
    }


class Trainer:
    def __init__(self, model_dir: Path, config: LearnerConfig, state: Path | None = None):
        torch.set_num_threads(config.threads)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        refuse_what_cannot_fit(model_dir, config)
        # The HF model, or the peft model wrapping it (LoRA).
        self.model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if config.lora is not None:
            self.model = with_adapters(self.model, config.lora.rank, config.lora.alpha, config.lora.targets,
                                       config.lora.router)
        else:
            freeze(self.model, config.frozen_parameters)
        router_replay.install(self.model)
        self.rank, self.world = rank_and_world()
        if self.world > 1:
            # FSDP2: each decoder layer's weights, grads and Adam state are split over
            # the ranks and gathered only for that layer's forward and backward.
            decoder: Any = causal_lm(self.model).model  # the family's decoder stack
            for layer in decoder.layers:
                fully_shard(layer)
            fully_shard(self.model)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.trainable, lr=config.lr)
        self.baseline = RunningBaseline()
        if state is not None:
            self.load_state(state)
        self.arch = Architecture.of(causal_lm(self.model).config)
        self.layers, self.top_k = self.arch.layers, self.arch.top_k
        self.parent: dict[str, torch.Tensor] | None = None  # the trained weights before the last version
        self.reference: dict[str, torch.Tensor] | None = None  # kl_reference=stable: its trained weights
        self.reference_dir: Path | None = None
        self.anchor: tuple[Batch, torch.Tensor] | None = None  # a version's skill anchor: samples, parent's logprobs

    def trained_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def load_state(self, state: Path) -> None:
        """Go on from `save_state`'s file, whatever number of ranks wrote it (each rank takes
        its shards of the whole tensors)."""
        saved = torch.load(state, weights_only=True)  # never unpickle arbitrary objects
        if missing := set(self.trained_names()) - set(saved["model"]):
            raise ValueError(f"{state}: it holds no {sorted(missing)[:3]} ({len(missing)} trained weights "
                             f"missing: was LIVERL_LEARNER__LORA or __FROZEN_PARAMETERS changed?)")
        whole = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, saved["model"], options=whole)
        try:
            set_optimizer_state_dict(self.model, self.optimizer, saved["optimizer"], options=whole)
        except (KeyError, ValueError, RuntimeError) as error:  # Adam's state is per trained tensor
            raise ValueError(f"{state}: its optimizer state was saved for other trained tensors "
                             f"(was LIVERL_LEARNER__FROZEN_PARAMETERS changed?): {error!r}") from error
        self.baseline.means = saved["baseline"]
        # Adam's saved state carries the lr it last used: a fixed lr is the setting's (so a
        # changed setting takes effect), an adapted one goes on from where it was.
        config = self.config
        self.lr = config.lr if config.target_kl is None else min(max(self.lr, config.lr_min), config.lr_max)

    def use_reference(self, model_dir: Path) -> None:
        """The stable version's trained weights as the KL's reference (`kl_reference=stable`;
        the frozen ones are the same in every version), each rank keeping its shards. Loaded
        whole (transformers maps the checkpoint's layout to the model's), kept in part."""
        if model_dir == self.reference_dir:
            return
        stable = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        trained = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.reference = {n: like(p, stable[n]) for n, p in trained.items()}
        self.reference_dir = model_dir

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = value

    def advantages(self, samples: list[RewardedSample]) -> torch.Tensor:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        # A group id is the tenant's own name: two tenants' groups never share a baseline.
        grouped = [f"{s.tenant}:{s.trajectory.group_id}" if s.trajectory.group_id else None for s in samples]
        lone = [i for i, g in enumerate(grouped) if g is None]
        advantages = group_advantages(rewards, [g or f"lone-{i}" for i, g in enumerate(grouped)],
                                      scale_by_std=self.config.group_advantage == "grpo")
        if lone:
            keys = [self.baseline_key(samples[i]) for i in lone]
            advantages[lone] = self.baseline.advantages(rewards[lone], keys)
        return advantages

    def baseline_key(self, sample: RewardedSample) -> str:
        """Whose running mean a lone completion's reward is compared with: its tenant's, or
        (`baseline_by=prompt_end`) that of its tenant's prompts ending in the same two
        tokens (a line ending in `:` and a newline, say), so prompts that are hard for the
        policy do not share a baseline with easy ones."""
        end = sample.trajectory.prompt_token_ids[-2:]
        if self.config.baseline_by == "prompt_end" and end:
            return f"{sample.tenant}|{','.join(map(str, end))}"
        return sample.tenant

    def train(self, samples: list[RewardedSample], seed: int = 0, lr_scale: float = 1.0,
              anchor: list[RewardedSample] | None = None, skill_check: SkillCheck | None = None,
              skill_floor: float | None = None) -> dict:
        """One version's worth of updates on `samples`, each step at `lr_scale` of the lr (a
        settled version's: learner/mix.py), holding the parent's likelihood of `anchor`'s
        completions with `skill_anchor_coef`, and the share of `skill_check`'s tasks solved at
        `skill_floor` or more (by the line search); returns its metrics."""
        self.model.train()
        anchored = self.config.skill_anchor_coef > 0 or self.config.max_skill_anchor_drop is not None
        self.anchor = self.anchored(anchor) if anchor and anchored else None
        advantages = self.advantages(samples)
        # The parent: the proximal policy of a trust region around it, the KL's reference
        # unless that is stable (kept by the service: `use_reference`), and the gate's baseline.
        self.parent = self.snapshot()
        kl_to_parent = self.config.kl_coef > 0 and self.config.kl_reference == "parent"
        parent = self.parent if self.around_parent or kl_to_parent else None
        reference = self.parent if self.config.kl_reference == "parent" else self.reference
        if self.config.kl_coef > 0 and reference is None:
            raise ValueError("kl_reference=stable: no reference weights (Trainer.use_reference)")
        # The first minibatch's samples, to see how far the version moves from its parent.
        watched, parent_watch = self.watch(samples[: self.config.minibatch])
        config = self.config
        limited = (config.max_kl_from_parent is not None or config.max_skill_anchor_drop is not None
                   or skill_check is not None)
        adam = copy.deepcopy(self.optimizer.state_dict()) if limited else None
        lr, step_lr, backtracks = self.lr, self.lr * lr_scale, 0
        warm = warmup_share(self.updates_taken(), config.lr_warmup_updates) == 1.0
        steps, failed, shift = self.steps(samples, advantages, seed, step_lr, parent, reference, watched, parent_watch)
        full_step_kl, anchor_drop, skill = shift.get("kl_from_parent"), self.anchor_drop(), self.skill(skill_check)
        while adam is not None and backtracked(shift.get("kl_from_parent"), config.max_kl_from_parent,
                                               anchor_drop.get("skill_anchor_drop"), config.max_skill_anchor_drop,
                                               backtracks, config.kl_backtracks, skill, skill_floor):
            self.restore(self.parent, adam)  # the step ran past the trust region: from the parent, half of it
            step_lr, backtracks = step_lr / 2, backtracks + 1
            steps, failed, shift = self.steps(samples, advantages, seed, step_lr, parent, reference, watched,
                                              parent_watch)
            anchor_drop, skill = self.anchor_drop(), self.skill(skill_check)
        self.lr = lr
        # A smaller step's KL says nothing of what the full step would move: not adapted by it
        # (a backtracked version's full step is its first; a warming-up one's is still to come).
        if self.config.target_kl is not None and full_step_kl is not None and lr_scale == 1.0 and warm:
            self.lr = adapted_lr(lr, full_step_kl, self.config.target_kl, self.config.lr_min, self.config.lr_max)
        return {"samples": len(samples), "lr": step_lr, "backtracks": backtracks, "updates": self.updates_taken(),
                "mean_reward": sum(s.reward for s in samples) / len(samples),
                **summarise(steps, self.config.router_replay), **advantage_stats(advantages), **shift,
                **anchor_drop,
                **({} if skill is None else {"skill_check_pass_rate": skill, "skill_check_floor": skill_floor}),
                # Samples that broke a step and were skipped: the service dead-letters them.
                "untrainable": {samples[i].sample_id: why for i, why in failed.items()}}

    def steps(self, samples: list[RewardedSample], advantages: torch.Tensor, seed: int, lr: float,
              parent: dict | None, reference: dict | None, watched: Batch | None,
              parent_watch: torch.Tensor | None) -> tuple[list[StepStats], dict[int, str], dict[str, float]]:
        """A version's gradient steps at `lr` (`epochs` passes over `samples` in minibatches), the
        samples that broke a step, and how far the steps moved the policy (`policy_shift`)."""
        steps: list[StepStats] = []
        failed: dict[int, str] = {}  # sample index -> why it could not be trained on
        order, rng = list(range(len(samples))), random.Random(seed)
        self.lr = lr
        for epoch in range(self.config.epochs):
            rng.shuffle(order)
            for minibatch in version_minibatches(order, self.config.minibatch, self.config.max_steps_per_version):
                if minibatch := [i for i in minibatch if i not in failed]:
                    steps += self.step_or_skip(samples, advantages, minibatch, epoch, parent, reference, failed)
        shift = {} if watched is None or parent_watch is None else policy_shift(
            parent_watch, self.vocabulary(watched), watched.completion_mask)
        return steps, failed, shift

    def anchored(self, samples: list[RewardedSample]) -> tuple[Batch, torch.Tensor]:
        """The skill anchor's batch and its parent's logprobs (the weights before the version's steps)."""
        batch = collate(samples, self.tokenizer.pad_token_id, self.layers, self.top_k)
        with torch.no_grad(), router_replay.replay(self.model, batch.routing if self.config.router_replay else None):
            return batch, token_logprobs(self.model, batch)

    def anchor_loss(self) -> torch.Tensor:
        """`skill_anchor_loss` on the version's anchor, now."""
        assert self.anchor is not None
        batch, parent_logp = self.anchor
        with router_replay.replay(self.model, batch.routing if self.config.router_replay else None):
            logp = token_logprobs(self.model, batch)
        return skill_anchor_loss(logp, parent_logp, batch.completion_mask)

    def anchor_drop(self) -> dict[str, float]:
        """How far below its parent's the version left the anchored completions' likelihood
        (mean nats a token under the hinge), and how many it anchored."""
        if self.anchor is None:
            return {}
        with torch.no_grad():
            drop = self.anchor_loss().item()
        return {"skill_anchor_drop": drop, "skill_anchor_samples": len(self.anchor[0].sample_of_row.unique())}

    def skill(self, check: SkillCheck | None) -> float | None:
        """The share of `check`'s tasks the version's weights solve greedily now (None: no check)."""
        return None if check is None else check.solve(causal_lm(self.model), self.tokenizer)

    def restore(self, weights: dict[str, torch.Tensor], adam: dict) -> None:
        """The trained weights and Adam's state as they were (`snapshot`, the optimizer's state dict)."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in weights:
                    p.copy_(weights[name])
        self.optimizer.load_state_dict(copy.deepcopy(adam))  # loading aliases its tensors: kept for the next

    @property
    def around_parent(self) -> bool:
        """The objective's trust region is centred on the version's parent."""
        return self.config.objective != "reinforce" and self.config.proximal == "parent"

    def step_or_skip(self, samples: list[RewardedSample], advantages: torch.Tensor, minibatch: list[int],
                     epoch: int, parent: dict | None, reference: dict | None,
                     failed: dict[int, str]) -> list[StepStats]:
        """The step on `minibatch`; if torch raises on it, a poison pill, not a stop: find the
        culprits by trying each sample alone (into `failed`), then step on the others."""
        try:
            return [self.step(samples, advantages, minibatch, epoch, parent, reference)]
        except Exception:  # anything a sample the checks let through makes torch raise
            if self.world > 1:
                raise  # one rank cannot drop a step the others take
            failed |= {i: why for i in minibatch if (why := self.trial(samples, i))}
            good = [i for i in minibatch if i not in failed]
            return [self.step(samples, advantages, good, epoch, parent, reference)] if good else []

    def step(self, samples: list[RewardedSample], advantages: torch.Tensor, minibatch: list[int], epoch: int,
             parent: dict[str, torch.Tensor] | None, reference: dict[str, torch.Tensor] | None) -> StepStats:
        """One gradient step on this rank's part of `minibatch`; returns what it measured."""
        idx, share, normalizer = self.shard(minibatch, samples)
        # Before the step's own forward: the routing statistics below read the last pass.
        coef = self.config.skill_anchor_coef
        anchor = coef * self.anchor_loss() if self.anchor is not None and coef > 0 else None
        batch = collate([samples[i] for i in idx], self.tokenizer.pad_token_id, self.layers, self.top_k)
        with router_replay.replay(self.model, batch.routing if self.config.router_replay else None):
            parent_logp, reference_logp, logp, vocab_logp = self.step_logprobs(batch, parent, reference)
        # A trajectory's advantage is credited to every one of its segments.
        row_advantages = advantages[idx][batch.sample_of_row] * share
        loss, objective = policy_gradient_loss(
            logp, batch.behaviour_logp, row_advantages, batch.completion_mask,
            objective=self.config.objective,
            proximal_logp=parent_logp if self.around_parent else batch.behaviour_logp,
            clip_low=self.config.clip_low, clip_high=self.config.clip_high,
            is_mode=self.config.is_mode, is_threshold=self.config.is_threshold,
            reference_logp=reference_logp, kl_coef=self.config.kl_coef, normalizer=normalizer,
        )
        if self.config.entropy_coef > 0:
            loss = loss - self.config.entropy_coef * entropy_bonus(vocab_logp, batch.completion_mask, normalizer)
        if anchor is not None:
            loss = loss + anchor
        self.optimizer.zero_grad()
        loss.backward()  # the last line that can fail: nothing below changes the weights
        # Train/inference mismatch, read in the first epoch, before this batch moves the weights.
        stats = self.mismatch(batch, logp) if epoch == 0 else StepStats()
        stats.objective = objective
        stats.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, 1.0))
        lr = self.lr
        self.lr = lr * warmup_share(self.updates_taken(), self.config.lr_warmup_updates)
        self.optimizer.step()
        self.lr = lr
        return stats

    def updates_taken(self) -> int:
        """Adam's own count of the updates behind its state (saved with it and restored by a
        rewind): where the policy is in its lr warmup."""
        state = next(iter(self.optimizer.state.values()), None)
        return int(state["step"]) if state else 0

    def mismatch(self, batch: Batch, logp: torch.Tensor) -> StepStats:
        """How far the learner's pass was from what served `batch`: the logprob of each written
        token, and where routing was recorded, the share routed elsewhere."""
        stats = StepStats(logprob_gap=(logp.detach() - batch.behaviour_logp).abs()[batch.completion_mask.bool()])
        if batch.routing is not None:
            stats.routed = int((batch.routing >= 0).all(-1).sum())
            stats.recomputed_mismatch = router_replay.routing_mismatch(
                router_replay.recomputed_routing(self.model), batch.routing, batch.attention)
            stats.replayed_mismatch = router_replay.routing_mismatch(
                router_replay.used_routing(self.model), batch.routing, batch.attention)
        return stats

    def step_logprobs(self, batch: Batch, parent: dict[str, torch.Tensor] | None,
                      reference: dict[str, torch.Tensor] | None):
        """(parent's, KL reference's, current) token logprobs of a step, and the current
        policy over the whole vocabulary when the entropy term needs it (else None)."""
        parent_logp = reference_logp = vocab_logp = None
        whole = self.config.entropy_coef > 0
        with torch.no_grad():
            if parent is not None:
                parent_logp = token_logprobs(self.model, batch, parent, whole)
            if self.config.kl_coef > 0:
                reference_logp = (parent_logp if reference is parent
                                  else token_logprobs(self.model, batch, reference, whole))
        # Last: the routing statistics read this pass.
        if whole:
            vocab_logp = vocabulary_logprobs(self.model, batch)
            logp = vocab_logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        else:
            logp = token_logprobs(self.model, batch)
        return parent_logp, reference_logp, logp, vocab_logp

    def watch(self, samples: list[RewardedSample]) -> tuple[Batch | None, torch.Tensor | None]:
        """The samples the version's shift from its parent is measured on (every rank the
        same), and the parent over the vocabulary there; (None, None) if they cannot be run
        (the training loop deals with the culprit)."""
        fit = [s for s in samples if problem(s, self.arch) is None]
        if not fit:
            return None, None
        try:
            batch = collate(fit, self.tokenizer.pad_token_id, self.layers, self.top_k)
            return batch, self.vocabulary(batch)
        except Exception:
            return None, None

    def vocabulary(self, batch: Batch) -> torch.Tensor:
        """The current policy over the vocabulary at `batch`'s positions, as served (no
        router replay, no dropout)."""
        training = self.model.training
        self.model.eval()
        with torch.no_grad():
            logp = vocabulary_logprobs(self.model, batch)
        self.model.train(training)
        return logp

    def trial(self, samples: list[RewardedSample], i: int) -> str | None:
        """Why a forward and backward on sample i alone fails, or None (no weights change)."""
        try:
            batch = collate([samples[i]], self.tokenizer.pad_token_id, self.layers, self.top_k)
            with router_replay.replay(self.model, batch.routing if self.config.router_replay else None):
                logp = token_logprobs(self.model, batch)
            (logp * batch.completion_mask).sum().backward()
            return None
        except Exception as error:
            return f"training failed: {error!r}"[:500]
        finally:
            self.optimizer.zero_grad()

    def shard(self, idx: list[int], samples: list[RewardedSample]) -> tuple[list[int], float, torch.Tensor | None]:
        """This rank's part of a minibatch, whether it counts (1.0) or only keeps the
        collectives in step (0.0), and the token count every rank divides its loss by."""
        if self.world == 1:
            return idx, 1.0, None
        mine = idx[self.rank :: self.world]
        share = 1.0 if mine else 0.0
        mine = mine or idx[:1]
        tokens = torch.tensor(float(sum(written_tokens(samples[i].trajectory) for i in mine)) * share)
        dist.all_reduce(tokens)
        # FSDP averages gradients over ranks; dividing by tokens/world makes that average
        # the gradient of the whole minibatch's token mean, as on one rank.
        return mine, share, tokens.clamp(min=1) / self.world

    def mean_log_ratios(self, samples: list[RewardedSample], of_parent: bool = False) -> torch.Tensor:
        """Per sample, mean over the tokens the policy wrote (all its segments) of
        log pi - log mu, under the current weights or (`of_parent`) those before the last
        `train` - what the offline gate weighs held-out samples by."""
        weights = self.parent if of_parent else None
        self.model.eval()
        out = []
        with torch.no_grad():
            for start in range(0, len(samples), self.config.minibatch):
                batch = collate(samples[start : start + self.config.minibatch],
                                self.tokenizer.pad_token_id, self.layers, self.top_k)
                logp = token_logprobs(self.model, batch, weights)
                diff = (logp - batch.behaviour_logp) * batch.completion_mask
                n = int(batch.sample_of_row.max()) + 1
                per_sample = torch.zeros(n).index_add_(0, batch.sample_of_row, diff.sum(1))
                written = torch.zeros(n).index_add_(0, batch.sample_of_row, batch.completion_mask.sum(1))
                out.append(per_sample / written.clamp(min=1))
        return torch.cat(out)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The weights training changes (all of them in full mode, the rest of a subset
        frozen, only the adapters under LoRA; this rank's shards under FSDP): the parent,
        for the trust region, the KL and the gate, without a copy of what does not move."""
        resharded(self.model)
        return {k: v.detach().clone() for k, v in self.model.named_parameters() if v.requires_grad}

    def master_state(self) -> dict[str, torch.Tensor]:
        """The full fp32 weights a version publishes, adapters merged (a collective under
        FSDP: gathered to rank 0, the other ranks get {})."""
        if self.world == 1:
            return published_state(self.model)
        # Full state dict: plain tensors, not DTensor shards or nested state.
        whole = cast(dict[str, torch.Tensor], get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
        if not hasattr(self.model, "peft_config"):
            return whole
        with gathered(self.model):  # each adapter merged from its whole A and B
            merged = adapted_weights(self.model)
        return {} if self.rank else published_state(self.model, whole, merged)

    def export(self, out_dir: Path) -> dict[str, torch.Tensor]:
        """Write the bf16 rounding of the master weights as an HF model, plus its probe
        (computed on the loaded model with the published values swapped in; under FSDP, on
        a load of the export), and return the master weights. A collective under FSDP:
        every rank calls it, rank 0 writes and returns them, the others get {}."""
        master = self.master_state()
        if self.rank:
            return master
        out_dir.mkdir(parents=True, exist_ok=True)
        lm = causal_lm(self.model)
        lm.config.dtype = torch.bfloat16
        lm.save_pretrained(out_dir, state_dict={k: v.detach().to(torch.bfloat16).contiguous()
                                                for k, v in master.items()})
        self.tokenizer.save_pretrained(out_dir)
        probe = probe_logprobs(out_dir, self.tokenizer, self.published_forward() if self.world == 1 else None)
        (out_dir / PROBE_FILE).write_text(json.dumps(probe))
        return master

    def published_forward(self):
        """logits(input_ids) as a replica serving the export computes them (fp32 from the bf16
        values), from the model in memory: no second load of the weights."""
        view = published_view(self.model)

        def forward(input_ids: torch.Tensor) -> torch.Tensor:
            # The merged adapters are in `view`: the adapters themselves must not add again.
            disable_adapter = getattr(self.model, "disable_adapter", None)  # a peft model's
            adapters = disable_adapter() if disable_adapter is not None else nullcontext()
            training = self.model.training
            self.model.eval()
            try:
                with adapters, torch.no_grad():
                    return torch.func.functional_call(self.model, view, args=(),
                                                      kwargs={"input_ids": input_ids}).logits
            finally:
                self.model.train(training)

        return forward

    def save_state(self, path: Path) -> None:
        """The trained weights' fp32 masters (the rest is the version's checkpoint), Adam's
        state and the running baselines, as whole tensors by name: any number of ranks
        goes on from it (`load_state`). A collective under FSDP; rank 0 writes."""
        whole = StateDictOptions(full_state_dict=True, cpu_offload=self.world > 1)
        trained = set(self.trained_names())
        model = {k: v for k, v in get_model_state_dict(self.model, options=whole).items() if k in trained}
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=whole)
        if self.rank:
            return
        tmp = path.with_suffix(".tmp")
        torch.save({"model": model, "optimizer": optimizer, "baseline": self.baseline.means}, tmp)
        tmp.replace(path)
