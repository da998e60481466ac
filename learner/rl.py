"""The RL math, one short function per idea, to be checked against the papers.

Notation: for each completion token t, log pi(t) is the learner's logprob now,
log mu(t) the behaviour logprob recorded when it was served (the sampling policy,
possibly several versions old), A the sequence's advantage, broadcast to its tokens.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def importance_weights(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, mode: str, threshold: float
) -> torch.Tensor:
    """Per-token pi/mu, made safe for off-policy training (no gradient flows through it).

    - "tis": truncated importance sampling, min(pi/mu, C) (Espeholt et al. 2018; Yao et
      al. 2025, "Your efficient RL framework secretly brings you off-policy RL").
    - "mask": tokens whose ratio leaves [1/C, C] get weight 0 (masked IS, as in
      IcePop / MIS): they are too far off-policy to trust either way.
    """
    ratio = torch.exp((logp - behaviour_logp).detach())
    if mode == "tis":
        return ratio.clamp(max=threshold)
    if mode == "mask":
        return torch.where((ratio <= threshold) & (ratio >= 1 / threshold), ratio, torch.zeros_like(ratio))
    raise ValueError(f"importance mode must be 'tis' or 'mask', not {mode!r}")


def version_minibatches(order: list[int], minibatch: int, max_steps: int) -> list[list[int]]:
    """One version's gradient steps over `order`: `minibatch` sequences each, unless that
    would take more than `max_steps` steps; then `max_steps` larger ones.

    Each Adam step moves the policy about lr whatever the batch, so the step count bounds
    how far a version drifts from the versions that served its samples (one or two back
    under asynchronous serving). Unbounded, a busy hour's big batch drifts far enough
    that pi/mu leaves the truncation range and the off-policy correction throws the
    signal away (docs/history.md, Demo).
    """
    size = max(minibatch, -(-len(order) // max_steps))  # ceil division
    return [order[start : start + size] for start in range(0, len(order), size)]


def group_advantages(rewards: torch.Tensor, group_ids: list[str], scale_by_std: bool = True) -> torch.Tensor:
    """GRPO (Shao et al. 2024): reward minus its group's mean, over the group's std.

    Several completions of one prompt share a group; the group mean is a baseline that
    needs no value network. A group whose rewards are all equal teaches nothing (A = 0).

    Without the std (`scale_by_std=False`: Dr. GRPO, Liu et al. 2025, "Understanding
    R1-Zero-like training"): dividing by it weighs a group that is nearly all solved (one
    failure in eight: A = -2.65 for it) as heavily as one split half and half, so once a
    task is learned its rare failures keep pushing the policy as hard as the learning did.
    """
    advantages = torch.zeros_like(rewards)
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    for idx in members.values():
        r = rewards[idx]
        if len(idx) > 1:
            advantages[idx] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6 if scale_by_std else 1.0)
    return advantages


class RunningBaseline:
    """Lone production completions have no group: subtract a running mean per key.

    An exponential moving average of reward per (tenant, task) is a low-variance,
    slowly moving baseline (Williams 1992's REINFORCE with baseline); it keeps the
    gradient unbiased because it does not depend on the sampled completion.
    """

    def __init__(self, decay: float = 0.95, initial: float = 0.0):
        self.decay = decay
        self.initial = initial
        self.means: dict[str, float] = {}

    def advantages(self, rewards: torch.Tensor, keys: list[str]) -> torch.Tensor:
        # Baselines come from before this batch, then take in its rewards.
        baseline = torch.tensor([self.means.get(k, self.initial) for k in keys], dtype=rewards.dtype)
        for k, r in zip(keys, rewards.tolist(), strict=True):
            self.means[k] = self.decay * self.means.get(k, r) + (1 - self.decay) * r
        return rewards - baseline


def kl_to_reference(logp: torch.Tensor, reference_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) with the k3 estimator (Schulman 2020): unbiased, >= 0."""
    log_ratio = reference_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def entropy_bonus(vocab_logp: torch.Tensor, mask: torch.Tensor,
                  normalizer: torch.Tensor | None = None) -> torch.Tensor:
    """The policy's entropy per token over the positions in `mask`, normalised like the loss
    (log-probabilities [batch, positions, vocab]):

        H(pi(. | s_t)) = - sum_v pi_v log pi_v

    Subtracted from the loss with a small weight (the entropy bonus of Williams & Peng
    1991, kept by A3C and PPO), it pushes back against a policy that turns certain before
    the reward has told it what to do, so it keeps sampling alternatives."""
    entropy = -(vocab_logp.exp() * vocab_logp).sum(-1)
    return (entropy * mask).sum() / (mask.sum().clamp(min=1) if normalizer is None else normalizer)


def policy_shift(parent_logp: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far a version moved from its parent, and how sure it still is: the mean over
    the positions in `mask` of the exact KL(parent || new) over the vocabulary and of the
    new policy's entropy (log-probabilities [batch, positions, vocab], mask [batch, positions]).

        KL(p || q) = sum_v p_v (log p_v - log q_v)        H(q) = - sum_v q_v log q_v

    A KL that jumps between versions, or an entropy that collapses, is a policy running
    off a cliff (the diagnostics PPO's trust region watches: Schulman et al. 2017)."""
    parent_logp, logp, mask = parent_logp.detach(), logp.detach(), mask.bool()
    kl = (parent_logp.exp() * (parent_logp - logp)).sum(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return {"kl_from_parent": kl[mask].mean().item(), "entropy": entropy[mask].mean().item()}


def skill_anchor_loss(logp: torch.Tensor, parent_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PPO-ptx (Ouyang et al. 2022, InstructGPT eq. 2) adds a log-likelihood term to the RL
    objective so that learning what users prefer does not pay for it in skills already learned.
    Here it is one-sided, on completions known to be right (rollouts that passed their task):

        mean_t max(0, log pi_parent(t) - log pi(t))

    Zero, with no gradient, while the version gives each token at least the likelihood its
    parent gave it; a pull back up wherever the rest of the step lowered it. It holds what
    rollouts taught without teaching it again: a replay of the groups pushes their successes
    further up and their failures down at every version (docs/learning.md)."""
    drop = (parent_logp.detach() - logp).clamp(min=0)
    return (drop * mask).sum() / mask.sum().clamp(min=1)


def adapted_lr(lr: float, kl: float, target_kl: float, lr_min: float, lr_max: float,
               factor: float = 1.5) -> float:
    """The next version's learning rate from how far this one moved from its parent: PPO's
    adaptive KL rule (Schulman et al. 2017, sec. 4, there for the penalty's weight) applied
    to the step size, as rl_games' "adaptive" schedule does:

        lr / 1.5   if KL > 2 * target       (the step ran further than meant: smaller)
        lr * 1.5   if KL < target / 2       (it barely moved: larger)
        lr         otherwise

    kept within [lr_min, lr_max]. Early, when every direction pays, versions take the step
    the target allows; when one overshoots, the next ones take less."""
    if kl > 2 * target_kl:
        lr /= factor
    elif kl < target_kl / 2:
        lr *= factor
    return min(max(lr, lr_min), lr_max)


def warmup_share(updates_taken: int, warmup_updates: int) -> float:
    """The share of the lr the policy's next optimizer update takes: a linear warmup over its
    first `warmup_updates` updates (nanoGPT's). Adam's first updates move every weight by
    about the whole lr whatever its gradient, since its second moment is estimated from one
    or two gradients: the day's first version moved 0.14-0.71 nats a token from the starter
    (target 0.04) in ten of ten runs of Nov 30, and took up to two thirds of its held-out skill."""
    if updates_taken >= warmup_updates:
        return 1.0
    return (updates_taken + 1) / warmup_updates


def backtracked(kl: float | None, max_kl: float | None, anchor_drop: float | None, max_anchor_drop: float | None,
                backtracks: int, most: int, skill: float | None = None, skill_floor: float | None = None) -> bool:
    """Undo the version and step again from its parent at half the lr? TRPO's line search
    (Schulman et al. 2015, appendix C: the step shrinks until the constraint holds), on the
    step size, at most `most` times, for a version that broke any constraint:

    - its KL from its parent passed `max_kl`. The adaptive step size acts only on the next
      version and PPO's clip only on each token's ratio: neither stops one version's handful
      of Adam steps from moving the policy 0.6-2 nats a token (the day of Nov 29: such
      versions took the coding skill at once);
    - it lowered the likelihood of the skill anchor's passed rollout completions by more
      than `max_anchor_drop` nats a token (`skill_anchor_loss`): a trust region on what the
      policy is known to do right, not on how far it moved (Nov 30: most candidates held for
      skill were one production version past stable, KL 0.003-0.08);
    - it solves a smaller share of the learner's check tasks greedily than `skill_floor`
      (learner/skill_check.py): the skill guard's own measure, on tasks it never judges."""
    past_kl = kl is not None and max_kl is not None and kl > max_kl
    past_drop = anchor_drop is not None and max_anchor_drop is not None and anchor_drop > max_anchor_drop
    under_floor = skill is not None and skill_floor is not None and skill < skill_floor
    return (past_kl or past_drop or under_floor) and backtracks < most


def advantage_stats(advantages: torch.Tensor) -> dict[str, float]:
    """What a batch's advantages look like: a std near 0 or most of them 0 means the
    batch teaches little (groups whose rewards are all equal); a large max, that a few
    samples dominate the step."""
    return {"advantage_mean": advantages.mean().item(),
            "advantage_std": advantages.std(unbiased=False).item(),
            "advantage_abs_max": advantages.abs().max().item(),
            "advantage_zero_fraction": (advantages == 0).float().mean().item()}


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float) -> torch.Tensor:
    """PPO's pessimistic clipped surrogate (Schulman et al. 2017), to be maximised:

        min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)

    with DAPO's decoupled range (Yu et al. 2025, "clip-higher": eps_high > eps_low leaves
    room to raise unlikely tokens). Once r leaves the range in the direction A pushes it,
    the gradient is zero: a step cannot pay for moving the policy further."""
    return torch.minimum(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)


def sequence_ratio(logp: torch.Tensor, proximal_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level ratio (Zheng et al. 2025): the geometric mean of the per-token
    ratios over each sequence's completion tokens, exp(mean_t (log pi - log pi_prox)),
    broadcast to its tokens. One number per sequence, as its reward is one number."""
    mean_log_ratio = ((logp - proximal_logp) * mask).sum(1) / mask.sum(1).clamp(min=1)
    return torch.exp(mean_log_ratio)[:, None].expand_as(logp)


def cispo_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, logp: torch.Tensor,
                    clip_low: float, clip_high: float) -> torch.Tensor:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped ratio, held constant,

        sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi

    so a token far from the proximal policy still gets a (bounded) gradient instead of none."""
    return ratio.clamp(1 - clip_low, 1 + clip_high).detach() * advantages * logp


OBJECTIVES = ("reinforce", "ppo", "gspo", "cispo")


def policy_gradient_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    objective: str = "reinforce",
    proximal_logp: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_mode: str = "tis",
    is_threshold: float = 2.0,
    reference_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Off-policy corrected policy gradient, token-level (shapes: [batch, tokens]).

    - "reinforce": loss = - sum_t w_t * A * log pi(t) / #tokens, w = pi/mu made safe
      (`importance_weights`): the importance-weighted REINFORCE estimator of grad E_pi[R].
      Nothing bounds how far a version moves from the policy that sampled.
    - "ppo", "gspo", "cispo": decoupled PPO (Hilton et al. 2022, "Batch size-invariance
      for policy optimization"): the trust region is around the proximal policy pi_prox
      (the version's parent, which the learner holds), r = pi/pi_prox; the off-policy
      correction for the behaviour version mu, w = pi_prox/mu made safe, is a constant.
      loss = - sum_t w_t * surrogate_t / #tokens, the surrogate per objective above.
      With pi_prox = mu (the learner's `proximal = behaviour`) this is classic PPO: w = 1
      and the region is around the policy that served each sample.

    Every objective normalises by the batch's token count (DAPO's token-level loss), plus
    kl_coef * KL(pi || ref) per token if asked. `normalizer` replaces #tokens when the
    batch is split over data-parallel ranks (every rank divides by the same count, so
    their averaged gradients equal one rank's).
    """
    A = advantages[:, None]
    if objective == "reinforce":
        weights = importance_weights(logp, behaviour_logp, is_mode, is_threshold)
        per_token = -weights * A * logp
        with torch.no_grad():
            ratio = torch.exp(logp - behaviour_logp)
            clipped = (ratio > is_threshold) | (weights == 0)
    elif objective in OBJECTIVES:
        if proximal_logp is None:
            raise ValueError(f"objective {objective!r} needs the proximal policy's logprobs")
        proximal_logp = proximal_logp.detach()
        weights = importance_weights(proximal_logp, behaviour_logp, is_mode, is_threshold)
        if objective == "gspo":
            ratio = sequence_ratio(logp, proximal_logp, mask)
        else:
            ratio = torch.exp(logp - proximal_logp)
        outside_high, outside_low = (ratio > 1 + clip_high).detach(), (ratio < 1 - clip_low).detach()
        if objective == "cispo":
            surrogate = cispo_surrogate(ratio, A, logp, clip_low, clip_high)
            clipped = outside_high | outside_low  # the weight is capped there
        else:
            surrogate = clipped_surrogate(ratio, A, clip_low, clip_high)
            clipped = (outside_high & (A > 0)) | (outside_low & (A < 0))  # the gradient is zero there
        per_token = -weights * surrogate
    else:
        raise ValueError(f"objective must be one of {OBJECTIVES}, not {objective!r}")
    if reference_logp is not None and kl_coef > 0:
        per_token = per_token + kl_coef * kl_to_reference(logp, reference_logp)
    tokens = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / (tokens if normalizer is None else normalizer)
    with torch.no_grad():
        stats = {
            "loss": loss.item(),
            "mean_is_weight": ((weights * mask).sum() / tokens).item(),
            "clipped_fraction": (clipped * mask).sum().item() / tokens.item(),
        }
    return loss, stats
