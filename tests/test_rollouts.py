"""Rollouts on the shared stack: a replica lent to rollouts samples GRPO groups of the
coding environment, scored in the sandbox, and the learner trains each group whole; a
multi-turn task runs end to end (served, summarised, scored, trained)."""

from __future__ import annotations

import asyncio
import random

import httpx
import torch
from helpers import wait_for

from learner import router_replay
from learner.segments import segments
from learner.trainer import Trainer, collate, problem, token_logprobs
from liverl.contracts import RewardedSample, Trajectory
from liverl.kafka import make_producer
from liverl.keys import admin_headers
from liverl.pool import ROLLOUT, read_pool, replica_async_client, set_replica
from liverl.settings import LearnerConfig, RolloutsConfig, Settings
from policies.registry import Registry
from rollouts import coding
from rollouts.coding import CodingEnvironment, solution_source
from rollouts.environment import Environment, Task
from rollouts.sandbox import run_tests
from rollouts.worker import Attempt, RolloutWorker, lent_replicas


def test_groups_sampled_on_a_lent_replica_are_published_whole_and_trained_together(settings, paused_learner):
    config = RolloutsConfig(group_size=4, levels=[1], max_tokens=8, scoring_threads=2)
    worker, replica, groups = lent_groups(settings, config, 2)
    for group in groups:
        assert len(group) == 4 and len({t.group_id for t in group}) == 1
        assert {(t.source, t.group_size, t.policy_version, t.tenant) for t in group} == {
            ("rollout", 4, replica.policy_version, "rollouts")}
        for t in group:  # what the replica sampled, with the behaviour logprob of every token
            assert t.completion_token_ids and len(t.completion_logprobs) == len(t.completion_token_ids)
    assert worker.counts["groups"] == 2 and worker.counts["cut"] == 0
    versions = train_and_wait(settings, groups)
    for group in groups:  # each group in one version
        assert len({versions[f"rollouts:{t.completion_id}"] for t in group}) == 1


def rewarded(t: Trajectory) -> RewardedSample:
    return RewardedSample(sample_id=f"rollouts:{t.completion_id}", event_id=f"rollouts:{t.completion_id}:r0",
                          tenant="rollouts", reward=1.0, reward_source="feedback", reward_fn_version="test",
                          trajectory=t)


def lent_groups(settings, config: RolloutsConfig, count: int):
    """`count` groups sampled by a worker with `config` on a replica lent by hand (lending
    itself is the scheduler's job, tested on its own): (worker, replica, groups)."""
    replica = read_pool(settings).general[-1]
    set_replica(settings, replica.name, alias=ROLLOUT)
    try:
        assert [r.name for r in lent_replicas(settings)] == [replica.name]
        worker = RolloutWorker(settings.model_copy(update={"rollouts": config}), seed=0)

        async def run():
            producer = make_producer(settings)
            await producer.start()
            async with replica_async_client(replica.url, 60) as client:
                try:
                    return [await worker.run_group(producer, client, replica) for _ in range(count)]
                finally:
                    await producer.stop()
        return worker, replica, asyncio.run(run())
    finally:
        set_replica(settings, replica.name, alias=None)


def train_and_wait(settings, groups) -> dict[str, str]:
    """Resume the learner until every trajectory of `groups` is trained: sample id -> version."""
    registry = Registry(settings.policies_dir)
    httpx.post(settings.url(settings.ports.learner) + "/resume", headers=admin_headers(settings), timeout=10)
    ids = [f"rollouts:{t.completion_id}" for group in groups for t in group]

    def trained() -> bool:
        httpx.post(settings.url(settings.ports.learner) + "/flush", headers=admin_headers(settings), timeout=10)
        return registry.trained(ids) == set(ids)
    wait_for(trained, timeout=180, interval=2)
    return dict(registry.db.execute(f"SELECT sample_id, version FROM trained_samples WHERE sample_id IN "
                                    f"({','.join('?' * len(ids))})", ids).fetchall())


def test_a_multi_turn_task_is_served_summarised_scored_and_trained(settings, paused_learner):
    """Attempts with a test-running tool in a 60-token context: the policy must summarise to
    go on. Every context the episode recorded is one the policy really read (the learner,
    rebuilding it from the turns, gets the replica's logprobs back), no context passes the
    window, and the learner trains the groups whole."""
    config = RolloutsConfig(environment="coding-feedback", levels=[1], group_size=2, max_tokens=8,
                            summary_tokens=8, context_tokens=60, scoring_threads=2)
    worker, replica, groups = lent_groups(settings, config, 2)
    assert worker.counts["groups"] == 2 and worker.counts["summaries"] > 0
    trajectories = [t for group in groups for t in group]
    summarised = [t for t in trajectories if any(turn.role == "summary" for turn in t.turns)]
    assert summarised
    model_dir = Registry(settings.policies_dir).get(replica.policy_version).model_dir
    trainer = Trainer(model_dir, LearnerConfig())
    for t in summarised:
        assert problem(rewarded(t), trainer.arch) is None
        assert all(len(s.token_ids) <= 60 for s in segments(t))
        batch = collate([rewarded(t)], trainer.tokenizer.pad_token_id, trainer.layers, trainer.top_k)
        trainer.model.eval()
        with torch.no_grad():
            logp = token_logprobs(trainer.model, batch)
        written = batch.completion_mask.bool()
        # bf16 weights served in fp32 by vLLM, fp32 here: the same contexts agree closely.
        assert (logp - batch.behaviour_logp)[written].abs().mean() < 0.05
        # Each segment carries the replica's routing (turn by turn) and the learner runs it.
        assert batch.routing is not None
        known = (batch.routing >= 0).all(-1)
        assert known.reshape(-1, *batch.input_ids.shape).any(-1).all()  # in every segment
        with torch.no_grad(), router_replay.replay(trainer.model, batch.routing):
            token_logprobs(trainer.model, batch)
        assert torch.equal(router_replay.used_routing(trainer.model)[known], batch.routing[known])
    versions = train_and_wait(settings, groups)
    for group in groups:
        assert len({versions[f"rollouts:{t.completion_id}"] for t in group}) == 1


class Echo(Environment):
    """Scores a completion by the length of its first line; counts what it was asked to score."""

    name = "echo"

    def __init__(self, same_line_same_score: bool):
        self.same_line_same_score, self.calls = same_line_same_score, []

    def tasks(self, split, rng):
        while True:
            yield Task(task_id="t", prompt="say something\n")

    def score(self, task, completion):
        self.calls.append(completion)
        return len(completion.split("\n")[0]) / 10

    def scored_as(self, task, completion):
        return completion.split("\n")[0] if self.same_line_same_score else None


def test_completions_an_environment_scores_alike_are_scored_once_and_each_gets_the_score():
    texts = ["a", "bb\nx", "a", "ccc", "bb\ny", "a"]
    attempts = [Attempt(text, {}, 1) for text in texts]
    for alike, runs in ((True, 3), (False, 6)):
        environment = Echo(alike)
        worker = RolloutWorker(Settings(), environment=environment)
        scores = asyncio.run(worker.score(Task(task_id="t", prompt=""), attempts))
        assert scores == [len(text.split("\n")[0]) / 10 for text in texts]  # in order, each its own
        assert len(environment.calls) == runs


def test_the_coding_environment_runs_one_program_once_per_group(monkeypatch):
    environment = CodingEnvironment(levels=[1])
    task = next(environment.tasks("train", random.Random(0)))
    programs = []

    def counted(source, cases, limits):
        programs.append(source)
        return run_tests(source, cases, limits)
    monkeypatch.setattr(coding, "run_tests", counted)
    right, wrong = task.reference, "None"
    texts = [right, right + "\n# more", wrong, right, wrong + "\n"]  # a program is the first line
    worker = RolloutWorker(Settings(), environment=environment)
    scores = asyncio.run(worker.score(task, [Attempt(text, {}, 1) for text in texts]))
    assert scores == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert sorted(programs) == sorted({solution_source(task, right), solution_source(task, wrong)})
