"""What a researcher looks at to see a collapse coming is recorded with every version:
how far it moved from its parent, its entropy, the gradient norms, the advantages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_distributed_learner import sampled

from learner.rl import policy_shift
from learner.trainer import Trainer, collate, token_logprobs, vocabulary_logprobs
from liverl.contracts import RewardedSample, Trajectory
from liverl.settings import LearnerConfig


def test_a_version_records_how_far_it_moved_from_its_parent(starter_dir: Path):
    samples = sampled(starter_dir, count=6)
    small, large = (Trainer(starter_dir, LearnerConfig(minibatch=3, lr=lr)).train(samples) for lr in (1e-7, 1e-3))
    # Adam moves every weight by about lr per step, so the KL grows about as lr squared.
    # (>= 0 up to float rounding: about -2e-8 when another test file ran first in the process)
    assert -1e-6 <= small["kl_from_parent"] < large["kl_from_parent"] / 100
    for metrics in (small, large):
        assert metrics["entropy"] > 0
        assert 0 < metrics["grad_norm"] <= metrics["grad_norm_max"]
        assert {"advantage_mean", "advantage_std", "advantage_abs_max", "advantage_zero_fraction"} <= set(metrics)


@pytest.mark.parametrize("objective", ["ppo", "gspo", "cispo"])
def test_trust_region_objectives_train_on_the_policy(starter_dir: Path, objective: str):
    """Each objective takes real steps on the starter (its parent as the proximal policy,
    router replay and all) and reports its clipping; the clipping itself is checked by
    hand in tests/test_learner_math.py."""
    samples = sampled(starter_dir, count=6)
    metrics = Trainer(starter_dir, LearnerConfig(minibatch=2, lr=1e-3, epochs=2, objective=objective)).train(samples)
    assert 0 <= metrics["clipped_fraction"] <= 1 and metrics["untrainable"] == {}
    assert metrics["kl_from_parent"] > 0 and metrics["mean_is_weight"] > 0


def test_a_trust_region_around_what_served_moves_less_than_reinforce_on_the_same_steps(starter_dir: Path):
    """Classic PPO (`proximal = behaviour`): the ratio is pi over the served policy, so the
    importance weight is 1 and, many epochs on the same samples at a large step, the
    learner runs into the clip instead of walking away from what users were served as
    REINFORCE does on the same steps."""
    samples = sampled(starter_dir, count=6)
    config = LearnerConfig(minibatch=6, lr=1e-3, epochs=12)
    free = Trainer(starter_dir, config).train(samples)
    ppo = config.model_copy(update={"objective": "ppo", "proximal": "behaviour"})
    bounded = Trainer(starter_dir, ppo).train(samples)
    assert bounded["mean_is_weight"] == pytest.approx(1.0) and bounded["untrainable"] == {}
    assert bounded["clipped_fraction"] > 0.1
    assert bounded["kl_from_parent"] < 0.75 * free["kl_from_parent"]  # 0.83 against 1.77 here


def test_an_entropy_bonus_keeps_the_policy_less_sure_than_the_same_steps_without(starter_dir: Path):
    """Many epochs on the same few samples make REINFORCE sure of them (the entropy the
    version records falls); the bonus, on the same steps, holds the entropy higher."""
    samples = sampled(starter_dir, count=6)
    config = LearnerConfig(minibatch=6, lr=1e-3, epochs=12)
    plain = Trainer(starter_dir, config).train(samples)
    exploring = Trainer(starter_dir, config.model_copy(update={"entropy_coef": 0.1})).train(samples)
    assert exploring["untrainable"] == {}
    assert exploring["entropy"] > plain["entropy"] + 0.05


def test_frozen_embeddings_stay_as_the_starter_has_them_while_the_rest_learns(starter_dir: Path, tmp_path: Path):
    """`frozen_parameters`: the update may change how the policy uses each token, not the
    token's own vectors in or out. A saved state resumed under another setting, or a name
    that matches no weight, is refused by name instead of failing deep in Adam or freezing
    nothing."""
    samples = sampled(starter_dir, count=6)
    trainer = Trainer(starter_dir, LearnerConfig(minibatch=3, lr=1e-3, frozen_parameters=["embed_tokens", "lm_head"]))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert trainer.train(samples)["kl_from_parent"] > 0
    after = trainer.model.state_dict()
    frozen = {"model.embed_tokens.weight", "lm_head.weight"}
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert any(not torch.equal(before[k], after[k]) for k in set(before) - frozen)
    trainer.save_state(tmp_path / "v1.pt")
    with pytest.raises(ValueError, match="FROZEN_PARAMETERS"):
        Trainer(starter_dir, LearnerConfig(), tmp_path / "v1.pt")
    with pytest.raises(ValueError, match="lm_heads"):
        Trainer(starter_dir, LearnerConfig(frozen_parameters=["lm_heads"]))


def test_the_adaptive_step_size_follows_the_kl_and_resumes_where_it_was(starter_dir: Path, tmp_path: Path):
    """With `target_kl`, a version that barely moved makes the next one's step larger and
    one that ran far makes it smaller; the lr reached is saved with the optimizer state
    and resumed from it (a rewind to stable resumes stable's). Without it the lr is the
    setting's, also when a state saved under another lr is resumed."""
    samples = sampled(starter_dir, count=6)
    config = LearnerConfig(minibatch=3, lr=3e-4, target_kl=1e-9)  # every version moves more: the step shrinks
    trainer = Trainer(starter_dir, config)
    first = trainer.train(samples)
    assert first["lr"] == 3e-4 and trainer.lr == pytest.approx(2e-4)
    trainer.save_state(tmp_path / "v1.pt")
    assert Trainer(starter_dir, config, tmp_path / "v1.pt").lr == pytest.approx(2e-4)
    assert Trainer(starter_dir, LearnerConfig(minibatch=3, lr=5e-5), tmp_path / "v1.pt").lr == 5e-5
    growing = Trainer(starter_dir, config.model_copy(update={"target_kl": 1e3}))  # it barely moves: larger
    growing.train(samples)
    assert growing.lr == pytest.approx(4.5e-4)
    with pytest.raises(ValueError, match="LR_MAX"):
        LearnerConfig(lr=2e-3, target_kl=0.01)


def test_a_kl_to_stable_pulls_a_drifted_policy_back_towards_it(starter_dir: Path, tmp_path: Path):
    """`kl_reference=stable`: the KL is to the version users get, not to each parent. A
    version trained away from the starter, then trained on samples that teach nothing (every
    reward equal, so the advantages are 0), moves back towards the starter (its reference)
    with a KL to stable, and not at all with a KL to its parent (which it equals)."""
    samples = sampled(starter_dir, count=6)
    drifted = Trainer(starter_dir, LearnerConfig(minibatch=3, lr=3e-3))
    drifted.train(samples)
    drifted.train(samples)
    drifted.export(tmp_path / "drifted")  # a version: its weights, no optimizer state
    flat = [s.model_copy(update={"reward": 1.0, "trajectory": s.trajectory.model_copy(update={"group_id": "g"})})
            for s in samples]  # one group, all alike: every advantage is 0
    starter = Trainer(starter_dir, LearnerConfig())
    batch = collate(samples, starter.tokenizer.pad_token_id, starter.layers, starter.top_k)
    with torch.no_grad():
        starter_logp = vocabulary_logprobs(starter.model, batch)

    def distance(trainer: Trainer) -> float:  # KL(starter || trainer) on the completions
        with torch.no_grad():
            return policy_shift(starter_logp, vocabulary_logprobs(trainer.model, batch),
                                batch.completion_mask)["kl_from_parent"]

    moved = {}
    for reference in ("stable", "parent"):
        trainer = Trainer(tmp_path / "drifted", LearnerConfig(minibatch=3, lr=1e-3, kl_coef=1.0,
                                                              kl_reference=reference))
        before = distance(trainer)
        if reference == "stable":
            with pytest.raises(ValueError, match="no reference weights"):
                trainer.train(flat)
            trainer.use_reference(starter_dir)
        trainer.train(flat)
        moved[reference] = distance(trainer) - before
    assert moved["stable"] < 0
    assert moved["parent"] == 0


def test_a_settled_version_steps_a_share_of_the_lr_and_leaves_the_adaptive_step_alone(starter_dir: Path):
    samples = sampled(starter_dir, count=6)
    config = LearnerConfig(minibatch=3, lr=1e-3, target_kl=1e-9, lr_min=1e-5, lr_max=1e-2)
    full, settled = Trainer(starter_dir, config), Trainer(starter_dir, config)
    full_metrics, settled_metrics = full.train(samples), settled.train(samples, lr_scale=0.1)
    assert (full_metrics["lr"], settled_metrics["lr"]) == pytest.approx((1e-3, 1e-4))
    # Adam moves every weight by about lr per step, so the KL goes about as lr squared.
    assert settled_metrics["kl_from_parent"] < full_metrics["kl_from_parent"] / 10
    # Both moved past the tiny target: the full step's lr is cut for the next version; the
    # settled step's KL says nothing of the full step, so its lr stays the setting's.
    assert (full.lr, settled.lr) == pytest.approx((1e-3 / 1.5, 1e-3))


def test_production_counts_as_learned_from_its_mean_reward_in_versions_without_fresh_rollouts():
    from learner.mix import settled_step

    assert settled_step([1.0, 1.0, 0.0, 1.0, 1.0], fresh_groups=0, settled_reward=0.8, scale=0.5) == 0.5
    assert settled_step([1.0, 0.0, 0.0, 1.0, 1.0], fresh_groups=0, settled_reward=0.8, scale=0.5) == 1.0  # 0.6
    assert settled_step([1.0] * 5, fresh_groups=2, settled_reward=0.8, scale=0.5) == 1.0  # rollouts teach: full
    assert settled_step([], fresh_groups=0, settled_reward=0.8, scale=0.5) == 1.0  # rollouts alone
    assert settled_step([1.0] * 5, fresh_groups=0, settled_reward=None, scale=0.5) == 1.0  # off


def test_after_the_guard_rewinds_the_learner_versions_take_a_smaller_step_until_one_is_promoted():
    from learner.mix import held_step

    assert held_step(0, 0.5, 0.125) == 1.0  # a new stable: no rewind to it yet
    assert (held_step(1, 0.5, 0.125), held_step(2, 0.5, 0.125)) == (0.5, 0.25)
    assert held_step(5, 0.5, 0.125) == 0.125  # the floor
    assert held_step(3, None, 0.125) == 1.0  # off


def test_a_version_that_ran_past_the_kl_limit_is_trained_again_from_its_parent_at_half_the_lr(starter_dir: Path):
    """TRPO's line search on the step size (`learner.max_kl_from_parent`): a version whose
    full step moved the policy past the limit is undone, weights and Adam state, and trained
    again from its parent at half the lr, until it holds or `kl_backtracks` ran out."""
    samples = sampled(starter_dir, count=6)
    config = LearnerConfig(minibatch=3, lr=1e-3)
    unlimited = Trainer(starter_dir, config).train(samples)
    limit = unlimited["kl_from_parent"] / 3  # the full step runs past it; a quarter step does not (KL ~ lr^2)
    limited = Trainer(starter_dir, config.model_copy(update={"max_kl_from_parent": limit, "kl_backtracks": 4}))
    metrics = limited.train(samples)
    assert 1 <= metrics["backtracks"] <= 2 and metrics["lr"] == pytest.approx(1e-3 / 2 ** metrics["backtracks"])
    assert metrics["kl_from_parent"] <= limit
    # Undone means undone: the same steps at that lr from a fresh start land on the same weights.
    same_lr = Trainer(starter_dir, config.model_copy(update={"lr": metrics["lr"]}))
    assert same_lr.train(samples)["kl_from_parent"] == pytest.approx(metrics["kl_from_parent"], rel=1e-4)
    steps_taken = [int(t.optimizer.state[t.trainable[0]]["step"]) for t in (limited, same_lr)]
    assert steps_taken[0] == steps_taken[1]  # Adam's state too: not the undone steps on top
    # Out of backtracks: the last try is kept and says so.
    stubborn = Trainer(starter_dir, config.model_copy(update={"max_kl_from_parent": 1e-12, "kl_backtracks": 1}))
    assert stubborn.train(samples)["backtracks"] == 1


def test_a_warming_up_policy_moves_less_in_its_first_updates_and_resumes_its_count(starter_dir: Path, tmp_path: Path):
    """`learner.lr_warmup_updates`: Adam's first updates move every weight by about the lr, so
    the policy's first version ran 4-18 times past the day's KL target. With a warmup the
    first updates take 1/N, 2/N, ... of the lr; the count is Adam's own, saved with its state,
    so a restarted learner goes on where it was; the adaptive step size waits for its end."""
    samples = sampled(starter_dir, count=6)  # two updates a version at minibatch 3
    config = LearnerConfig(minibatch=3, lr=1e-3, target_kl=1e-9)
    cold = Trainer(starter_dir, config).train(samples)
    warming = Trainer(starter_dir, config.model_copy(update={"lr_warmup_updates": 10}))
    first = warming.train(samples)  # its updates at 0.1 and 0.2 of the lr: KL ~ lr^2
    assert first["updates"] == 2 and first["kl_from_parent"] < cold["kl_from_parent"] / 10
    assert warming.lr == 1e-3  # not adapted on a step smaller than the lr's
    warming.save_state(tmp_path / "v1.pt")
    resumed = Trainer(starter_dir, config.model_copy(update={"lr_warmup_updates": 10}), tmp_path / "v1.pt")
    assert resumed.updates_taken() == 2
    assert resumed.train(samples)["updates"] == 4


def test_the_skill_anchor_holds_the_parents_likelihood_of_passed_completions_a_step_pushes_down(starter_dir: Path):
    """`learner.skill_anchor_coef`: a version whose production samples push down completions a
    rollout found right (here, the same completions rejected) keeps more of its parent's
    likelihood of them with the anchor than the same steps without, and says how much it lost."""
    samples = sampled(starter_dir, count=6)
    passed = [s.model_copy(update={"reward": 1.0}) for s in samples[:3]]
    rejected = [s.model_copy(update={"reward": 0.0, "sample_id": f"p{i}"}) for i, s in enumerate(samples[:3])]
    accepted = [s.model_copy(update={"reward": 1.0}) for s in samples[3:]]
    config = LearnerConfig(minibatch=6, lr=1e-3, epochs=4)

    def likelihood(trainer: Trainer) -> float:
        batch = collate(passed, trainer.tokenizer.pad_token_id, trainer.layers, trainer.top_k)
        with torch.no_grad():
            logp = token_logprobs(trainer.model, batch)
        return float((logp * batch.completion_mask).sum() / batch.completion_mask.sum())

    parent = likelihood(Trainer(starter_dir, config))
    free = Trainer(starter_dir, config)
    held = Trainer(starter_dir, config.model_copy(update={"skill_anchor_coef": 5.0}))
    free_metrics = free.train(rejected + accepted, anchor=passed)  # coef 0: the anchor is not used
    held_metrics = held.train(rejected + accepted, anchor=passed)
    lost_free, lost_held = parent - likelihood(free), parent - likelihood(held)
    assert lost_free > 0.1  # the rejection pushed them down
    assert lost_held < lost_free / 2
    assert "skill_anchor_drop" not in free_metrics
    assert held_metrics["skill_anchor_samples"] == 3 and 0 <= held_metrics["skill_anchor_drop"] < lost_free


def test_a_version_that_lowered_its_skill_anchor_past_the_limit_is_trained_again_at_half_the_lr(starter_dir: Path):
    """`learner.max_skill_anchor_drop`: the line search of `max_kl_from_parent`, on what the
    policy is known to do right. A version whose steps lowered the anchor's passed completions
    by more than the limit (here production rejected the same completions) is undone and
    trained again at half the lr until it holds; the anchor itself adds nothing to the loss."""
    samples = sampled(starter_dir, count=6)
    passed = [s.model_copy(update={"reward": 1.0}) for s in samples[:3]]
    rejected = [s.model_copy(update={"reward": 0.0, "sample_id": f"p{i}"}) for i, s in enumerate(samples[:3])]
    accepted = [s.model_copy(update={"reward": 1.0}) for s in samples[3:]]
    config = LearnerConfig(minibatch=6, lr=1e-3, epochs=4, kl_backtracks=4)
    full = Trainer(starter_dir, config.model_copy(update={"max_skill_anchor_drop": 1e9})).train(
        rejected + accepted, anchor=passed)
    assert full["backtracks"] == 0 and full["skill_anchor_drop"] > 0.1
    limit = full["skill_anchor_drop"] / 3
    limited = Trainer(starter_dir, config.model_copy(update={"max_skill_anchor_drop": limit})).train(
        rejected + accepted, anchor=passed)
    assert 1 <= limited["backtracks"] <= 3 and limited["lr"] == pytest.approx(1e-3 / 2 ** limited["backtracks"])
    assert limited["skill_anchor_drop"] <= limit
    # Without passed completions to anchor (no rollouts yet) there is nothing to hold.
    alone = Trainer(starter_dir, config.model_copy(update={"max_skill_anchor_drop": limit})).train(rejected + accepted)
    assert alone["backtracks"] == 0 and "skill_anchor_drop" not in alone


def test_a_version_that_solves_fewer_check_tasks_than_its_floor_is_trained_again_at_half_the_lr(
        starter_dir: Path):
    """`learner.skill_check_tasks`: after its steps the learner solves training-split tasks
    greedily, as the evaluator solves held-out ones, and a version under its floor is undone
    and trained again at half the lr, up to kl_backtracks times, then published as it is."""
    from learner.skill_check import SkillCheck
    from rollouts.coding import CodingEnvironment

    environment = CodingEnvironment(levels=[1], train_params="wide")
    check = SkillCheck(environment, tasks=12, margin=0.0, max_tokens=16)
    assert not {t.task_id for t in check.tasks} & {t.task_id for t in environment.heldout(200)}
    samples = sampled(starter_dir, count=6)
    config = LearnerConfig(minibatch=6, lr=1e-3, epochs=2, kl_backtracks=2)
    trainer = Trainer(starter_dir, config)
    kept = trainer.train(samples, skill_check=check, skill_floor=0.0)
    assert kept["backtracks"] == 0 and kept["skill_check_floor"] == 0.0
    # The share recorded is that of the weights the version keeps (its fp32 master weights: the
    # bf16 export can break a near-tie between two tokens otherwise, on one CPU and not another).
    solved = check.last
    assert trainer.skill(check) == kept["skill_check_pass_rate"] == sum(solved) / 12 and check.last == solved
    # A floor no step reaches: the line search runs out of tries, and the version is published.
    unreachable = Trainer(starter_dir, config).train(samples, skill_check=check, skill_floor=1.01)
    assert unreachable["backtracks"] == 2 and unreachable["lr"] == pytest.approx(1e-3 / 4)
    assert "skill_check_pass_rate" not in Trainer(starter_dir, config).train(samples)  # no check, no figure


def test_the_check_floor_is_stables_share_less_the_margin_or_a_lower_parents_own(tmp_path: Path):
    """Stable's share binds the steps since stable together; a parent already under it, its own."""
    from learner.skill_check import SkillCheck
    from rollouts.coding import CodingEnvironment

    check = SkillCheck(CodingEnvironment(levels=[1]), tasks=10, margin=0.1, max_tokens=16)
    for version, solved in (("v3", 5), ("v5", 4), ("v6", 7)):
        check.last = [True] * solved + [False] * (10 - solved)
        check.remember(version)
    assert check.floor(("v6", ""), ("v3", "")) == pytest.approx(0.4)  # stable v3's 0.5, less 0.1
    assert check.floor(("v5", ""), ("v3", "")) == pytest.approx(0.4)  # the parent's 0.4: no lower
    check.last = [True] * 3 + [False] * 7
    check.remember("v7")
    assert check.floor(("v7", ""), ("v3", "")) == pytest.approx(0.3)  # a parent under stable's floor: its own
    with pytest.raises(OSError):  # a version never checked is read from its weights
        check.floor(("v8", str(tmp_path / "absent")), ("v3", ""))


def test_the_check_is_not_asked_of_a_learner_on_several_ranks():
    with pytest.raises(ValueError, match="SKILL_CHECK_TASKS needs one rank"):
        LearnerConfig(skill_check_tasks=10, ranks=2)


def test_the_anchor_draws_members_that_did_better_than_their_group():
    from learner.mix import ReplayBuffer

    def member(group: str, i: int, reward: float) -> RewardedSample:
        trajectory = Trajectory(event_id=f"{group}{i}", tenant="r", completion_id=f"{group}{i}", policy_version="v0",
                                prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[-1.0],
                                group_id=group, group_size=3, source="rollout")
        return RewardedSample(sample_id=f"{group}{i}", event_id=f"{group}{i}", tenant="r", reward=reward,
                              reward_source="feedback", reward_fn_version="t", trajectory=trajectory)

    buffer = ReplayBuffer(8)
    buffer.remember([[member("a", 0, 1.0), member("a", 1, 0.0), member("a", 2, 0.0)],
                     [member("b", 0, 0.5), member("b", 1, 1.0), member("b", 2, 0.0)]])
    assert sorted(s.sample_id for s in buffer.passed(10, seed=0)) == ["a0", "b1"]  # b0 is its group's mean
    assert len(buffer.passed(1, seed=0)) == 1
    assert {buffer.passed(1, seed=s)[0].sample_id for s in range(20)} == {"a0", "b1"}  # a draw per version


def test_the_learners_own_groups_are_sampled_from_its_weights_scored_by_the_environment_and_trained(
        starter_dir: Path):
    """`learner.own_groups`: each version samples groups of training-split tasks from its
    parent's weights: whole groups of the rollout size, each member's behaviour logprobs the
    trainer's own (importance weight 1), its reward the environment's score of its text, the same
    draw for the same version, a new one for the next; and a version trains on them."""
    from learner.own_groups import OwnGroups
    from learner.trainer import problem
    from liverl.settings import RolloutsConfig
    from rollouts.coding import CodingEnvironment

    environment = CodingEnvironment(levels=[1, 2], train_params="wide")
    rollouts = RolloutsConfig(environment="coding", levels=[1, 2], group_size=8, max_tokens=16)
    trainer = Trainer(starter_dir, LearnerConfig(minibatch=16, lr=1e-3))
    sampler = OwnGroups(environment, groups=2, rollouts=rollouts)
    own = sampler.sample(trainer, "v0", seq=1)
    assert sampler.seconds > 0  # what it cost the learner's pace: the version's metrics carry it (own_seconds)
    tasks = {task.prompt: task for task in sampler.tasks(seq=1)}
    heldout = {t.prompt for t in environment.heldout(200)}
    groups = {s.trajectory.group_id for s in own}
    assert len(groups) == 2 and all(sum(s.trajectory.group_id == g for s in own) == 8 for g in groups)
    for sample in own:
        t = sample.trajectory
        assert problem(sample, trainer.arch) is None and t.prompt_text not in heldout
        assert t.group_size == 8 and t.policy_version == "v0" and sample.tenant == rollouts.tenant
        assert sample.reward == environment.score(tasks[t.prompt_text], t.completion_text)
        batch = collate([sample], trainer.tokenizer.pad_token_id, trainer.layers, trainer.top_k)
        with torch.no_grad():
            mine = token_logprobs(trainer.model, batch)[batch.completion_mask.bool()]
        assert torch.allclose(mine, torch.tensor(t.completion_logprobs), atol=1e-5)
        assert "\n" not in t.completion_text
    again = OwnGroups(environment, 2, rollouts).sample(trainer, "v0", seq=1)  # a restarted learner's
    assert [s.trajectory.completion_token_ids for s in again] == [s.trajectory.completion_token_ids for s in own]
    assert {t.prompt for t in sampler.tasks(seq=2)} != set(tasks)  # the next version, other tasks
    metrics = trainer.train(own)
    assert metrics["samples"] == 16 and metrics["untrainable"] == {}


def test_an_own_completion_is_what_a_replica_would_report_it_wrote(starter_dir: Path):
    """Through the token that completed the stop string, or through its end-of-sequence token;
    never the padding after either (the starter pads with its end-of-sequence id)."""
    from transformers import AutoTokenizer

    from learner.own_groups import until_stop, written_ids

    tokenizer = AutoTokenizer.from_pretrained(starter_dir)
    eos = tokenizer.eos_token_id
    line = tokenizer.encode("return a + b", add_special_tokens=False)
    rest = tokenizer.encode("\n    return b", add_special_tokens=False)
    stopped = written_ids(line + rest + [eos, eos], tokenizer, ("\n",))
    assert stopped == line + rest[:len(stopped) - len(line)] and "\n" in tokenizer.decode(stopped)
    assert until_stop(tokenizer.decode(stopped), ("\n",)) == "return a + b"
    assert written_ids(line + [eos, eos, eos], tokenizer, ("\n",)) == line + [eos]
    assert written_ids(line, tokenizer, ("\n",)) == line  # cut by max_tokens


def test_own_groups_are_not_asked_of_a_learner_on_several_ranks_nor_of_a_multi_turn_environment():
    from learner.own_groups import OwnGroups
    from liverl.settings import RolloutsConfig

    with pytest.raises(ValueError, match="OWN_GROUPS needs one rank"):
        LearnerConfig(own_groups=4, ranks=2)
    with pytest.raises(ValueError, match="'coding-feedback' is played over several"):
        OwnGroups.configured(LearnerConfig(own_groups=4), RolloutsConfig(environment="coding-feedback"))
    assert OwnGroups.configured(LearnerConfig(), RolloutsConfig()) is None
