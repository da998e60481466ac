"""The sink on a real chdb: revisions in one consumer batch count once in the rollup, and
an event id is the tenant's own (two tenants may use one)."""

from __future__ import annotations

import pytest

from feedback.sink import Sink
from feedback.warehouse import SCHEMA, ChdbBackend, query_json
from liverl.contracts import FeedbackEvent, RewardedSample, Topics, Trajectory
from liverl.kafka import encode


@pytest.fixture(scope="module")
def sink(tmp_path_factory) -> Sink:
    warehouse = ChdbBackend(tmp_path_factory.mktemp("chdb"))
    for statement in SCHEMA:
        warehouse.command(statement)
    return Sink(warehouse)


def sample(cid: str, revision: int, reward: float, accepted: bool | None) -> bytes:
    trajectory = Trajectory(event_id=cid, tenant="acme", completion_id=cid, policy_version="v1",
                            prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[-1.0])
    return encode(RewardedSample(sample_id=f"acme:{cid}", revision=revision, event_id=f"acme:{cid}:r{revision}",
                                 tenant="acme", reward=reward, reward_source="feedback",
                                 reward_fn_version="t", accepted=accepted, trajectory=trajectory))


def rollup(sink: Sink) -> list[dict]:
    return query_json(sink.warehouse, "SELECT sum(samples) AS n, sum(reward_sum) AS reward, sum(accepted) AS accepted, "
                                      "sum(judged) AS judged FROM version_hourly WHERE tenant = 'acme'")


def test_two_revisions_in_one_batch_count_once(sink):
    sink.store(Topics.SAMPLES, [sample("c1", 0, 0.0, False), sample("c1", 1, 1.0, True)])
    assert rollup(sink) == [{"n": 1, "reward": 1, "accepted": 1, "judged": 1}]
    sink.store(Topics.SAMPLES, [sample("c1", 2, 0.0, False)])  # a later batch corrects it too
    assert rollup(sink) == [{"n": 1, "reward": 0, "accepted": 0, "judged": 1}]
    sink.store(Topics.SAMPLES, [sample("c1", 1, 1.0, True)])  # a redelivery changes nothing
    assert rollup(sink) == [{"n": 1, "reward": 0, "accepted": 0, "judged": 1}]


def test_one_event_id_two_tenants_two_rows(sink):
    def event(tenant: str) -> bytes:
        return encode(FeedbackEvent(event_id="evt-1", tenant=tenant, timestamp="2026-11-22T12:00:00Z",
                                    body={"kind": "accept", "completion_id": "c"}))

    sink.store(Topics.FEEDBACK, [event("acme"), event("globex")])
    sink.store(Topics.FEEDBACK, [event("globex")])  # a real duplicate
    rows = query_json(sink.warehouse, "SELECT tenant, count() AS n FROM feedback_events GROUP BY tenant ORDER BY tenant")
    assert rows == [{"tenant": "acme", "n": 1}, {"tenant": "globex", "n": 1}]
