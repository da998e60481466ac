"""Multi-turn trajectories with self-summarisation, as the learner trains them: on a
hand-built trajectory, the loss covers exactly the policy's own tokens in every segment
(task, tool outputs and the summary carried into a new context masked), and the one final
reward is credited to every segment, the summary included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.rl import policy_gradient_loss
from learner.segments import segments, written_tokens
from learner.trainer import Trainer, collate, problem, token_logprobs
from liverl.contracts import Architecture, RewardedSample, Trajectory, Turn
from liverl.settings import LearnerConfig

ARCH = Architecture(vocab_size=100, layers=2, experts=4, top_k=2)


def hand_built(reward: float = 1.0, **changes) -> RewardedSample:
    """Task [1 2 3]; the policy writes [4 5], the tool answers [6], the policy writes [7];
    asked to summarise [8], it writes the summary [9 10]; the new context is the task and
    that summary [1 2 3 9 10 11]; the policy writes [12 13] and the task is scored."""
    turns = [
        Turn(role="user", token_ids=[1, 2, 3]),
        Turn(role="assistant", token_ids=[4, 5], logprobs=[-0.1, -0.2]),
        Turn(role="tool", token_ids=[6]),
        Turn(role="assistant", token_ids=[7], logprobs=[-0.3]),
        Turn(role="user", token_ids=[8]),
        Turn(role="summary", token_ids=[9, 10], logprobs=[-0.4, -0.5], summarizes_turns=[0, 1, 2, 3]),
        Turn(role="user", token_ids=[1, 2, 3, 9, 10, 11]),
        Turn(role="assistant", token_ids=[12, 13], logprobs=[-0.6, -0.7]),
    ]
    t = Trajectory(event_id="t", tenant="rollouts", completion_id="c", policy_version="v0", source="rollout",
                   **{"turns": turns, **changes})
    return RewardedSample(sample_id="rollouts:c", event_id="rollouts:c:r0", tenant="rollouts", reward=reward,
                          reward_source="feedback", reward_fn_version="test", trajectory=t)


def test_segments_are_cut_after_each_summary_and_mark_only_the_policys_tokens():
    first, second = segments(hand_built().trajectory)
    assert first.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert first.written == [False] * 3 + [True] * 2 + [False] + [True] + [False] + [True] * 2
    assert first.behaviour_logprobs == [0.0] * 3 + [-0.1, -0.2, 0.0, -0.3, 0.0, -0.4, -0.5]
    assert second.token_ids == [1, 2, 3, 9, 10, 11, 12, 13]
    # The summary is read in the second context: masked there, trained where it was written.
    assert second.written == [False] * 6 + [True] * 2
    assert written_tokens(hand_built().trajectory) == 7


def test_the_loss_covers_written_tokens_in_every_segment_with_one_advantage():
    batch = collate([hand_built()], pad_id=0, layers=2, top_k=2)
    assert batch.sample_of_row.tolist() == [0, 0]
    # Position j predicts token j + 1: the mask is the written flags shifted by one.
    assert batch.completion_mask[0].tolist() == [0, 0, 1, 1, 0, 1, 0, 1, 1]
    assert batch.completion_mask[1].tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0]
    # With pi = mu on every token (importance weight 1), REINFORCE's gradient on a token's
    # logprob is -A / (#written tokens) where written and exactly 0 elsewhere.
    logp = batch.behaviour_logp.clone().requires_grad_(True)
    advantage = torch.tensor([0.7])
    loss, _ = policy_gradient_loss(logp, batch.behaviour_logp, advantage[batch.sample_of_row],
                                   batch.completion_mask)
    loss.backward()
    expected = -0.7 / 7 * batch.completion_mask
    assert torch.allclose(logp.grad, expected)


def test_training_on_a_rewarded_trajectory_reinforces_every_segment_and_the_summary(starter_dir: Path):
    sample = hand_built(reward=1.0)  # a lone sample: advantage = reward - a baseline of 0
    # One step small enough to follow the gradient (at 1e-2 it overshoots: some tokens fall).
    trainer = Trainer(starter_dir, LearnerConfig(minibatch=1, lr=1e-3, max_steps_per_version=1))
    batch = collate([sample], trainer.tokenizer.pad_token_id, trainer.layers, trainer.top_k)
    with torch.no_grad():
        before = token_logprobs(trainer.model, batch)
    metrics = trainer.train([sample])
    assert metrics["tokens"] == 7 and not metrics["untrainable"]
    with torch.no_grad():
        after = token_logprobs(trainer.model, batch)
    mask = batch.completion_mask.bool()
    summary = torch.zeros_like(mask)
    summary[0, 7:9] = True  # targets 9 and 10: the summary, written in the first segment
    assert (after - before)[summary].min() > 0
    assert (after - before)[1][mask[1]].min() > 0  # the second segment's answer


def test_the_gate_weighs_a_multi_turn_sample_over_all_its_written_tokens(starter_dir: Path):
    trainer = Trainer(starter_dir, LearnerConfig())
    sample = hand_built()
    batch = collate([sample], trainer.tokenizer.pad_token_id, trainer.layers, trainer.top_k)
    with torch.no_grad():
        logp = token_logprobs(trainer.model, batch)
    by_hand = ((logp - batch.behaviour_logp) * batch.completion_mask).sum() / 7
    assert trainer.mean_log_ratios([sample]).item() == pytest.approx(by_hand.item(), abs=1e-5)


MALFORMED = {  # what is wrong: (which turn, the change)
    "a turn without token ids": (2, {"token_ids": None}),
    "logprobs that do not match": (1, {"logprobs": [-0.1]}),
    "a positive logprob": (3, {"logprobs": [0.5]}),
    "a token id past the vocabulary": (2, {"token_ids": [100]}),
}


def test_malformed_turns_never_reach_training():
    assert problem(hand_built(), ARCH) is None
    for name, (index, change) in MALFORMED.items():
        turns = list(hand_built().trajectory.turns)
        turns[index] = turns[index].model_copy(update=change)
        assert problem(hand_built(turns=turns), ARCH) is not None, name
    no_context = [Turn(role="assistant", token_ids=[4], logprobs=[-0.1])]
    assert "context" in problem(hand_built(turns=no_context), ARCH)
    assert "single-turn" in problem(hand_built(routed_experts=[[[0, 1], [2, 3]]]), ARCH)


def test_turns_without_token_ids_are_a_record_and_the_completion_trains():
    t = Trajectory(event_id="t", tenant="acme", completion_id="c", policy_version="v0",
                   prompt_token_ids=[1, 2], completion_token_ids=[3], completion_logprobs=[-1.0],
                   turns=[Turn(role="user", content="hi"), Turn(role="assistant", content="hello")])
    (only,) = segments(t)
    assert only.token_ids == [1, 2, 3] and only.written == [False, False, True]
