"""Rollouts on the shared stack: a replica lent to rollouts samples GRPO groups of the
coding environment, scored in the sandbox, and the learner trains each group whole."""

from __future__ import annotations

import asyncio

import httpx
from helpers import wait_for

from liverl.kafka import make_producer
from liverl.keys import admin_headers
from liverl.pool import ROLLOUT, read_pool, replica_async_client, set_replica
from liverl.settings import RolloutsConfig
from policies.registry import Registry
from rollouts.worker import RolloutWorker, lent_replicas


def test_groups_sampled_on_a_lent_replica_are_published_whole_and_trained_together(settings, paused_learner):
    registry = Registry(settings.policies_dir)
    replica = read_pool(settings).general[-1]
    set_replica(settings, replica.name, alias=ROLLOUT)  # by hand: the scheduler's job, tested on its own
    try:
        assert [r.name for r in lent_replicas(settings)] == [replica.name]
        config = RolloutsConfig(group_size=4, levels=[1], max_tokens=8, scoring_threads=2)
        worker = RolloutWorker(settings.model_copy(update={"rollouts": config}), seed=0)

        async def two_groups():
            producer = make_producer(settings)
            await producer.start()
            async with replica_async_client(replica.url, 60) as client:
                try:
                    return [await worker.run_group(producer, client, replica) for _ in range(2)]
                finally:
                    await producer.stop()
        groups = asyncio.run(two_groups())
    finally:
        set_replica(settings, replica.name, alias=None)
    for group in groups:
        assert len(group) == 4 and len({t.group_id for t in group}) == 1
        assert {(t.source, t.group_size, t.policy_version, t.tenant) for t in group} == {
            ("rollout", 4, replica.policy_version, "rollouts")}
        for t in group:  # what the replica sampled, with the behaviour logprob of every token
            assert t.completion_token_ids and len(t.completion_logprobs) == len(t.completion_token_ids)
    assert worker.counts["groups"] == 2 and worker.counts["cut"] == 0
    httpx.post(settings.url(settings.ports.learner) + "/resume", headers=admin_headers(settings), timeout=10)
    ids = [f"rollouts:{t.completion_id}" for group in groups for t in group]

    def trained() -> bool:
        httpx.post(settings.url(settings.ports.learner) + "/flush", headers=admin_headers(settings), timeout=10)
        return registry.trained(ids) == set(ids)
    wait_for(trained, timeout=180, interval=2)
    for group in groups:
        group_ids = [f"rollouts:{t.completion_id}" for t in group]
        versions = registry.db.execute(f"SELECT DISTINCT version FROM trained_samples WHERE sample_id IN "
                                       f"({','.join('?' * len(group_ids))})", group_ids).fetchall()
        assert len(versions) == 1
