"""The RL math and router replay on a tiny Qwen3-MoE built in the test (no stack needed)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from learner import router_replay
from learner.rl import (
    RunningBaseline,
    adapted_lr,
    advantage_stats,
    cispo_surrogate,
    clipped_surrogate,
    entropy_bonus,
    group_advantages,
    importance_weights,
    kl_to_reference,
    policy_gradient_loss,
    policy_shift,
    sequence_ratio,
    version_minibatches,
    warmup_share,
)
from policies.offline_eval import offline_check, snis, snis_difference


def tiny_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    model = Qwen3MoeForCausalLM(config)
    for router in router_replay.moe_routers(model):
        torch.nn.init.normal_(router.weight, std=1.0)  # routers start at zero: give them opinions
    router_replay.install(model)
    return model


def test_the_adaptive_step_size_by_hand():
    """PPO's adaptive rule on the lr: a version that moved more than twice the target KL
    makes the next step 1.5 times smaller, one under half of it 1.5 times larger, and
    in between the step stays; never outside [lr_min, lr_max]."""
    assert adapted_lr(3e-4, kl=0.05, target_kl=0.02, lr_min=1e-5, lr_max=1e-3) == pytest.approx(2e-4)
    assert adapted_lr(3e-4, kl=0.005, target_kl=0.02, lr_min=1e-5, lr_max=1e-3) == pytest.approx(4.5e-4)
    assert adapted_lr(3e-4, kl=0.02, target_kl=0.02, lr_min=1e-5, lr_max=1e-3) == 3e-4
    assert adapted_lr(8e-4, kl=0.0, target_kl=0.02, lr_min=1e-5, lr_max=1e-3) == 1e-3
    assert adapted_lr(1.2e-5, kl=1.0, target_kl=0.02, lr_min=1e-5, lr_max=1e-3) == 1e-5


def test_the_lr_warmup_by_hand():
    """nanoGPT's linear warmup, counted in the policy's optimizer updates: the first of N
    takes 1/N of the lr, the N-th the whole, and every one after it too; 0: no warmup."""
    assert [warmup_share(n, 4) for n in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_share(0, 0) == 1.0


def test_truncated_and_masked_importance_weights():
    logp = torch.log(torch.tensor([0.5, 0.9, 0.1]))
    behaviour = torch.log(torch.tensor([0.5, 0.3, 0.4]))
    assert torch.allclose(importance_weights(logp, behaviour, "tis", 2.0), torch.tensor([1.0, 2.0, 0.25]))
    assert torch.allclose(importance_weights(logp, behaviour, "mask", 2.0), torch.tensor([1.0, 0.0, 0.0]))
    with pytest.raises(ValueError):
        importance_weights(logp, behaviour, "nope", 2.0)


def test_group_advantages_are_relative_within_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5])
    adv = group_advantages(rewards, ["a", "a", "b", "b", "c"])
    assert adv[0] > 0 > adv[1]
    assert adv[2] == adv[3] == 0  # a group that all agree teaches nothing
    assert adv[4] == 0            # a lone completion has no group baseline


def test_dr_grpo_does_not_blow_up_the_rare_failure_of_a_nearly_solved_group():
    """One failure in eight, by hand: GRPO divides by the group's std (sqrt(7)/8), so the
    failure gets -(7/8) / (sqrt(7)/8) = -sqrt(7), as large as any advantage of a group split
    half and half (+-1); Dr. GRPO keeps the reward minus the mean: -7/8 and +1/8."""
    rewards = torch.tensor([0.0] + [1.0] * 7 + [0.0] * 4 + [1.0] * 4)
    groups = ["solved"] * 8 + ["split"] * 8
    grpo = group_advantages(rewards, groups)
    assert grpo[0].item() == pytest.approx(-7 ** 0.5, rel=1e-4)
    assert grpo[8:].abs().max().item() == pytest.approx(1.0, rel=1e-4)
    dr = group_advantages(rewards, groups, scale_by_std=False)
    assert dr[0].item() == pytest.approx(-7 / 8) and dr[1].item() == pytest.approx(1 / 8)
    assert dr[8:].tolist() == [-0.5] * 4 + [0.5] * 4


def test_a_version_takes_a_bounded_number_of_steps_over_every_sample_once():
    small = version_minibatches(list(range(40)), minibatch=16, max_steps=6)
    assert [len(s) for s in small] == [16, 16, 8]  # the minibatch as set when it fits
    busy = version_minibatches(list(range(1000)), minibatch=16, max_steps=6)
    assert len(busy) == 6 and sorted(i for s in busy for i in s) == list(range(1000))
    assert version_minibatches([], minibatch=16, max_steps=6) == []


def test_running_baseline_uses_only_past_rewards():
    baseline = RunningBaseline(decay=0.5)
    first = baseline.advantages(torch.tensor([1.0, 0.0]), ["t", "t"])
    assert torch.allclose(first, torch.tensor([1.0, 0.0]))  # nothing seen yet: baseline 0
    second = baseline.advantages(torch.tensor([1.0]), ["t"])
    assert 0 < second.item() < 1


def test_kl_k3_is_non_negative_and_zero_at_equality():
    logp = torch.log(torch.tensor([0.2, 0.5, 0.9]))
    assert torch.all(kl_to_reference(logp, logp) == 0)
    assert torch.all(kl_to_reference(logp, torch.log(torch.tensor([0.3, 0.1, 0.5]))) > 0)


def test_policy_shift_by_hand():
    """Parent (0.5, 0.5), new (0.9, 0.1) at the one position in the mask:
    KL = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5108; H = -(0.9 ln 0.9 + 0.1 ln 0.1) = 0.3251.
    The masked-out position (where parent and new differ wildly) does not count."""
    parent = torch.log(torch.tensor([[[0.5, 0.5], [0.99, 0.01]]]))
    new = torch.log(torch.tensor([[[0.9, 0.1], [0.01, 0.99]]]))
    shift = policy_shift(parent, new, torch.tensor([[1.0, 0.0]]))
    assert shift["kl_from_parent"] == pytest.approx(0.5108, abs=1e-4)
    assert shift["entropy"] == pytest.approx(0.3251, abs=1e-4)
    assert policy_shift(parent, parent, torch.ones(1, 2))["kl_from_parent"] == pytest.approx(0.0, abs=1e-7)


def test_entropy_bonus_by_hand_and_its_gradient_flattens_the_policy():
    """Positions with (0.5, 0.5) and (0.9, 0.1) in the mask: H = ln 2 = 0.6931 and 0.3251,
    mean 0.5091; the masked-out position does not count. A step down the loss minus the
    bonus moves the sure position towards uniform and leaves the uniform one where it is."""
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.999, 0.001]]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    bonus = entropy_bonus(torch.log_softmax(logits, -1), mask)
    assert bonus.item() == pytest.approx((0.6931 + 0.3251) / 2, abs=1e-4)
    assert entropy_bonus(torch.log_softmax(logits, -1), mask, normalizer=torch.tensor(4.0)).item() == \
        pytest.approx((0.6931 + 0.3251) / 4, abs=1e-4)
    (-bonus).backward()
    assert logits.grad[0, 1, 0] > 0 > logits.grad[0, 1, 1]  # descending lowers the likely token's logit
    assert logits.grad[0, 0].abs().max() < 1e-6 and logits.grad[0, 2].abs().max() == 0


def test_advantage_stats_by_hand():
    stats = advantage_stats(torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert stats == {"advantage_mean": 0.0, "advantage_std": pytest.approx(0.7071, abs=1e-4),
                     "advantage_abs_max": 1.0, "advantage_zero_fraction": 0.5}


def test_policy_gradient_raises_logprob_of_advantaged_tokens():
    logits = torch.zeros(1, 3, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :1]  # the token that was sampled: index 0
    loss, stats = policy_gradient_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 1))
    loss.backward()
    assert logits.grad[0, 0] < 0  # descending the loss raises the sampled token's logit
    assert stats["mean_is_weight"] == pytest.approx(1.0)


def test_router_replay_forces_served_routing_and_reports_mismatch():
    model = tiny_moe()
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids)
    natural = router_replay.recomputed_routing(model)          # [layers, tokens, k]
    served = torch.roll(natural, shifts=1, dims=-1) % 4        # a different routing
    served[..., 1] = (served[..., 0] + 1) % 4                  # two distinct experts per token
    with router_replay.replay(model, served):
        replayed = model(input_ids=ids).logits
    plain = model(input_ids=ids).logits
    assert not torch.allclose(replayed, plain)                 # routing really was forced
    mask = torch.ones(2, 8)
    assert router_replay.routing_mismatch(natural, natural, mask) == 0.0
    assert router_replay.routing_mismatch(natural, served, mask) > 0.0
    with router_replay.replay(model, natural):                 # replaying its own choice
        assert torch.allclose(model(input_ids=ids).logits, plain, atol=1e-6)


def gate(candidate_log_ratio, parent_log_ratio, rewards, margin=0.0, **kwargs):
    """offline_check on the same held-out samples, as the learner calls it."""
    return offline_check(snis(candidate_log_ratio, rewards), snis(parent_log_ratio, rewards),
                         snis_difference(candidate_log_ratio, parent_log_ratio, rewards), margin, min_ess=5, **kwargs)


def test_offline_gate_needs_evidence():
    rewards = torch.tensor([1.0, 0.0] * 20)
    same, better = torch.zeros(40), torch.where(rewards > 0, 0.3, -0.3)
    assert gate(better, same, rewards).passed
    assert not gate(same[:3], same[:3], rewards[:3]).passed  # too few samples for a verdict
    assert not gate(torch.where(rewards > 0, -0.6, 0.6), same, rewards).passed
    # Better on the logs, but too far from what users get now: held at the gate.
    far = gate(better, same, rewards, kl_from_stable=0.3, max_kl=0.1)
    assert not far.passed and far.reason == "moved too far from stable: KL 0.3000 > ceiling 0.1"
    assert far.too_far_from_stable
    assert gate(better, same, rewards, kl_from_stable=0.05, max_kl=0.1).passed


def test_offline_gate_judges_the_difference_on_the_same_samples():
    """Both estimates are made on the same samples, so their noise is shared: a candidate
    a little off its parent passes on 40 samples, where its own interval (about +-0.15 at a
    pass rate of one half) alone would have needed several hundred for a margin of 0.1; one
    that moved weight from passes to failures by as much as the margin is held."""
    rewards = torch.tensor([1.0, 0.0] * 20)
    parent = torch.linspace(-0.2, 0.2, 40)
    close = parent + torch.where(rewards > 0, -0.02, 0.02)
    verdict = gate(close, parent, rewards, margin=0.1)
    assert verdict.passed and verdict.candidate.lower < verdict.parent.value - 0.1
    assert verdict.difference.value < 0 and verdict.difference.lower > -0.1
    assert not gate(parent + torch.where(rewards > 0, -0.4, 0.4), parent, rewards, margin=0.1).passed


def test_the_offline_gate_is_calibrated_at_its_margin():
    """Simulated held-out logs (a reward of one with probability 0.3, the parent the logging
    policy): a candidate as good as its parent passes nearly always on 50 samples, and one whose
    true value is the margin (0.1) below its parent's passes about as often as the 95% bound
    allows (2.5% expected)."""
    generator = torch.Generator().manual_seed(0)

    def passes(gap: float, n: int = 50, p: float = 0.3) -> bool:
        rewards = (torch.rand(n, generator=generator) < p).float()
        parent = 0.05 * torch.randn(n, generator=generator)
        # Weight moved off the passes so that the candidate's true value is p - gap, and
        # moved at random besides (a candidate is never its parent exactly).
        moved = torch.where(rewards > 0, math.log((p - gap) / p), math.log((1 - p + gap) / (1 - p)))
        candidate = parent + moved + 0.1 * torch.randn(n, generator=generator)
        return gate(candidate, parent, rewards, margin=0.1).passed

    assert sum(passes(0.0) for _ in range(400)) >= 0.95 * 400
    assert sum(passes(0.1) for _ in range(400)) <= 0.06 * 400


def test_kl_between_versions_is_zero_for_the_same_weights_and_grows_with_a_change(starter_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from policies.divergence import kl_between

    changed = tmp_path / "changed"
    shutil.copytree(starter_dir, changed)
    weights = load_file(changed / "model.safetensors")
    head = next(k for k in weights if "lm_head" in k or "embed" in k)
    generator = torch.Generator().manual_seed(0)
    weights[head] = weights[head] + 0.05 * torch.randn(weights[head].shape, generator=generator).to(weights[head].dtype)
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    sequences = [([1, 5, 9, 14, 20, 33], 2), ([7, 8, 9, 10], 1), ([3], 1)]  # the last has no completion
    assert kl_between(starter_dir, starter_dir, sequences) == pytest.approx(0.0, abs=1e-6)
    assert kl_between(starter_dir, changed, sequences) > 1e-4
    assert kl_between(starter_dir, changed, [([3], 1)]) is None


def test_clipped_surrogate_by_hand():
    # r = 1.5 with A = +1 is clipped to 1.28 (clip-higher); r = 0.5 with A = -1 to 0.8;
    # inside the range, or where clipping would only help, r A stays.
    ratio = torch.tensor([1.5, 0.5, 1.1, 0.5])
    advantages = torch.tensor([1.0, -1.0, 1.0, 1.0])
    got = clipped_surrogate(ratio, advantages, clip_low=0.2, clip_high=0.28)
    assert torch.allclose(got, torch.tensor([1.28, -0.8, 1.1, 0.5]))


def test_sequence_ratio_is_the_geometric_mean_over_completion_tokens():
    logp = torch.log(torch.tensor([[0.4, 0.9, 0.3]]))
    proximal = torch.log(torch.tensor([[0.2, 0.3, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third position is padding
    expected = (0.4 / 0.2 * 0.9 / 0.3) ** 0.5  # sqrt(2 * 3)
    assert torch.allclose(sequence_ratio(logp, proximal, mask), torch.full((1, 3), expected))


def test_cispo_weight_is_clipped_and_constant():
    logp = torch.log(torch.tensor([0.6, 0.1])).requires_grad_()
    ratio = torch.exp(logp - torch.log(torch.tensor([0.3, 0.4])))  # 2.0 and 0.25
    cispo_surrogate(ratio, torch.tensor([1.0, 1.0]), logp, 0.2, 0.28).sum().backward()
    # d/dlogp of sg(clip(r)) * A * logp is clip(r) * A: 1.28 and 0.8, never 0
    assert torch.allclose(logp.grad, torch.tensor([1.28, 0.8]))


def test_decoupled_objectives_bound_the_step_around_the_proximal_policy():
    """At pi = pi_prox the token-level objectives are REINFORCE weighted by pi_prox/mu; once pi has moved
    past the clip in the advantage's direction, PPO and GSPO give no gradient."""
    behaviour = torch.log(torch.tensor([[0.25, 0.5]]))
    proximal = torch.log(torch.tensor([[0.5, 0.5]]))  # pi_prox/mu = 2 on the first token
    mask, advantages = torch.ones(1, 2), torch.tensor([1.0])
    # -w_t A / #tokens per token; GSPO's one ratio per sequence spreads the sum evenly
    expected = {"ppo": [-1.0, -0.5], "cispo": [-1.0, -0.5], "gspo": [-0.75, -0.75]}
    for objective, gradient in expected.items():
        logp = proximal.clone().requires_grad_()
        loss, stats = policy_gradient_loss(logp, behaviour, advantages, mask, objective=objective,
                                           proximal_logp=proximal, is_threshold=2.0)
        loss.backward()
        assert torch.allclose(logp.grad, torch.tensor([gradient])), objective
        assert stats["mean_is_weight"] == pytest.approx(1.5) and stats["clipped_fraction"] == 0.0
    for objective in ("ppo", "gspo"):
        logp = (proximal + 0.5).requires_grad_()  # r = e^0.5 = 1.65 > 1.28 on both tokens
        loss, stats = policy_gradient_loss(logp, behaviour, advantages, mask, objective=objective,
                                           proximal_logp=proximal)
        loss.backward()
        assert torch.count_nonzero(logp.grad) == 0 and stats["clipped_fraction"] == 1.0, objective
    with pytest.raises(ValueError, match="proximal"):
        policy_gradient_loss(proximal, behaviour, advantages, mask, objective="ppo")
    with pytest.raises(ValueError, match="objective"):
        policy_gradient_loss(proximal, behaviour, advantages, mask, objective="trpo")


def test_a_baseline_per_prompt_end_keeps_hard_prompts_apart_from_easy_ones(starter_dir):
    """Lone completions of prompts ending `...:\\n` (always refused) and `... [` (always
    accepted): one baseline per tenant makes every refusal look worse than average (-0.95),
    one per prompt end finds each as expected (0)."""
    from learner.trainer import Trainer
    from liverl.contracts import RewardedSample, Trajectory
    from liverl.settings import LearnerConfig

    def lone(i: int, prompt: list[int], reward: float) -> RewardedSample:
        t = Trajectory(event_id=f"t{i}", tenant="acme", completion_id=f"c{i}", policy_version="v0",
                       prompt_token_ids=prompt, completion_token_ids=[3], completion_logprobs=[-1.0])
        return RewardedSample(sample_id=f"acme:c{i}", event_id=f"acme:c{i}:r0", tenant="acme", reward=reward,
                              reward_source="feedback", reward_fn_version="test", trajectory=t)

    easy, hard = [5, 7, 9], [5, 8, 10]
    for baseline_by, expected in (("tenant", [0.05, -0.95]), ("prompt_end", [0.0, 0.0])):
        trainer = Trainer(starter_dir, LearnerConfig(baseline_by=baseline_by))
        trainer.advantages([lone(0, easy, 1.0), lone(1, hard, 0.0)])  # means: 1 then 0.95 / 1 and 0
        got = trainer.advantages([lone(2, easy, 1.0), lone(3, hard, 0.0)])
        assert torch.allclose(got, torch.tensor(expected)), baseline_by
