"""What the ingest API acknowledges, the stream and the learner can use: trajectories fit
the serving policy, numbers are finite, timestamps have a zone, trajectories need a scope,
hostile bodies get a 4xx, admin routes need an admin key and are audited, tenants are
rate-limited, tenants sharing a completion id share nothing, and no tenant can send the
rollout worker's score."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers import item, sql, wait_for

from feedback.rewards import RewardConfigFile, Rewarder
from ingest.api import create_app
from ingest.schemas import IngestItem, ItemError, to_event
from liverl.audit import AuditLog
from liverl.contracts import ROLLOUT_SCORE, FeedbackEvent, OutcomeBody, Trajectory, utcnow
from liverl.keys import KeyStore
from liverl.settings import IngestConfig, Settings


def trajectory(cid: str, **body) -> dict:
    base = {"completion_id": cid, "policy_version": "v0", "prompt_token_ids": [5, 6, 7],
            "completion_token_ids": [8, 9], "completion_logprobs": [-1.0, -2.0]}
    return item(f"t-{cid}", base | body, type="trajectory")


def results(api, items: list[dict]) -> list[dict]:
    response = api.post("/v1/ingestion", json={"batch": items})
    assert response.status_code == 207, response.text
    return response.json()["results"]


def layers_and_k(settings) -> tuple[int, int]:
    from policies.registry import Registry

    config = json.loads((Path(Registry(settings.policies_dir).stable().model_dir) / "config.json").read_text())
    return config["num_hidden_layers"], config["num_experts_per_tok"]


def test_a_trajectory_must_fit_the_serving_policy(settings, api):
    layers, k = layers_and_k(settings)
    right = [[list(range(k))] * layers] * 5
    cases = {
        "completion_token_ids": trajectory(uuid.uuid4().hex, completion_token_ids=[8, 10_000_000]),
        "prompt_token_ids": trajectory(uuid.uuid4().hex, prompt_token_ids=[-1, 6, 7]),
        "routed_experts": trajectory(uuid.uuid4().hex, routed_experts=[[list(range(k))] * (layers + 1)] * 5),
        "routed_experts ": trajectory(uuid.uuid4().hex, routed_experts=[[[10_000] * k] * layers] * 5),
    }
    answers = results(api, [*cases.values(), trajectory(uuid.uuid4().hex, routed_experts=right)])
    for (field, _), answer in zip(cases.items(), answers[:-1], strict=True):
        assert answer["status"] == 400 and f"body.{field.strip()}" in answer["error"], answer
    assert answers[-1]["status"] == 201


def test_trajectories_need_the_scope(settings, stack):
    key, _ = KeyStore(settings.keys_file).create(f"noscope{uuid.uuid4().hex[:6]}")  # feedback only
    with httpx.Client(base_url=settings.url(settings.ports.api), headers={"Authorization": f"Bearer {key}"}) as c:
        answers = results(c, [trajectory(uuid.uuid4().hex),
                              item(f"f-{uuid.uuid4().hex}", {"kind": "accept", "completion_id": "x"})])
    assert answers[0]["status"] == 403 and "trajectories" in answers[0]["error"]
    assert answers[1]["status"] == 201


@pytest.mark.parametrize("raw, field", [
    ('{"batch": [{"id": "nan-%s", "type": "trajectory", "timestamp": "2026-11-22T12:00:00Z", "body": '
     '{"completion_id": "c", "policy_version": "v0", "prompt_token_ids": [5], "completion_token_ids": [8], '
     '"completion_logprobs": [NaN]}}]}', "completion_logprobs"),
    ('{"batch": [{"id": "inf-%s", "type": "feedback", "timestamp": "2026-11-22T12:00:00Z", "body": '
     '{"kind": "score", "completion_id": "c", "score": 1e400}}]}', "score"),
    ('{"batch": [{"id": "naive-%s", "type": "feedback", "timestamp": "2026-11-22T12:00:00", "body": '
     '{"kind": "accept", "completion_id": "c"}}]}', "timestamp"),
])
def test_refused_at_the_door_what_the_stream_could_not_process(api, raw, field):
    response = api.post("/v1/ingestion", content=(raw % uuid.uuid4().hex).encode(),
                        headers={"content-type": "application/json"})
    answer = response.json()["results"][0]
    assert answer["status"] == 400 and field in answer["error"], answer


def test_hostile_bodies_get_a_4xx(settings, api, dev_keys):
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    assert api.post("/v1/ingestion", content=deep).status_code == 400
    admin = {"Authorization": f"Bearer {dev_keys['admin_key']}", "content-type": "application/json"}
    assert httpx.post(settings.url(settings.ports.api) + "/admin/keys", content=deep, headers=admin).status_code == 400
    spec = httpx.get(settings.url(settings.ports.api) + "/openapi.json").json()
    assert spec["paths"]["/v1/ingestion"]["post"]["requestBody"]["required"]
    assert "KeyRequest" in json.dumps(spec["paths"]["/admin/keys"]["post"]["requestBody"])


def test_admin_routes_need_an_admin_key_and_are_audited(settings, api, dev_keys):
    assert api.get("/admin/keys").status_code == 403  # the tenant key
    assert httpx.get(settings.url(settings.ports.api) + "/admin/keys").status_code == 401
    admin = {"Authorization": f"Bearer {dev_keys['admin_key']}"}
    tenant = f"audited{uuid.uuid4().hex[:6]}"
    created = httpx.post(settings.url(settings.ports.api) + "/admin/keys", headers=admin,
                         json={"tenant": tenant, "scopes": ["feedback", "trajectories"]}).json()
    assert created["scopes"] == ["feedback", "trajectories"]
    assert httpx.post(settings.url(settings.ports.api) + "/admin/keys", headers=admin,
                      json={"tenant": "has:colon"}).status_code == 422  # ':' would make sample ids ambiguous
    revoked = httpx.delete(settings.url(settings.ports.api) + f"/admin/keys/{created['key_id']}", headers=admin)
    assert revoked.status_code == 200
    admin_id = next(r.key_id for r in KeyStore(settings.keys_file).list() if r.role == "admin")
    trail = [(e.actor, e.action) for e in AuditLog(settings.audit_file).entries() if e.target == tenant]
    assert trail == [(admin_id, "keys.create"), (admin_id, "keys.revoke")]


def test_a_tenant_over_its_rate_gets_429_with_retry_after(tmp_path):
    settings = Settings(data_dir=tmp_path, ingest=IngestConfig(tenant_events_per_s=1.0, tenant_events_burst=5.0,
                                                               delivery_timeout_s=0.5))
    busy, _ = KeyStore(settings.keys_file).create("busy")
    calm, _ = KeyStore(settings.keys_file).create("calm")
    batch = {"batch": [item(f"r{i}", {"kind": "accept", "completion_id": "c"}) for i in range(5)]}
    with TestClient(create_app(settings)) as client:  # no broker: items answer 503, limits first
        def send(key: str):
            return client.post("/v1/ingestion", json=batch, headers={"Authorization": f"Bearer {key}"})

        assert send(busy).status_code == 207  # the burst
        refused = send(busy)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert "busy" in refused.json()["detail"]
        assert send(calm).status_code == 207  # another tenant is not slowed


def test_the_limiter_refills_at_its_rate_and_lets_a_big_batch_through_into_debt():
    from liverl.ratelimit import TenantRateLimiter

    limiter = TenantRateLimiter(rate_per_s=10.0, burst=5.0)
    assert limiter.take("t", 8) == 0.0  # more than the burst: allowed on a full bucket...
    assert limiter.take("t", 1) == pytest.approx(0.4, abs=0.01)  # ...and repaid: 3 owed + 1 at 10/s


def test_two_tenants_with_one_completion_id_share_nothing(settings, api):
    other_key, _ = KeyStore(settings.keys_file).create(f"other{uuid.uuid4().hex[:6]}",
                                                       scopes=["feedback", "trajectories"])
    other = httpx.Client(base_url=settings.url(settings.ports.api), headers={"Authorization": f"Bearer {other_key}"})
    cid = f"task-{uuid.uuid4().hex}"
    mine = results(api, [trajectory(cid), item(f"a-{uuid.uuid4().hex}", {"kind": "accept", "completion_id": cid})])
    theirs = results(other, [trajectory(cid), item(f"b-{uuid.uuid4().hex}", {"kind": "reject", "completion_id": cid})])
    assert [r["status"] for r in mine + theirs] == [201] * 4
    rows = wait_for(lambda: (r := sql(settings, f"SELECT tenant, reward FROM samples FINAL WHERE "
                                                f"sample_id LIKE '%:{cid}' ORDER BY tenant")) and len(r) == 2 and r)
    tenants = {r["tenant"]: r["reward"] for r in rows}
    assert tenants["dev"] == 1 and min(tenants.values()) == 0
    assert sql(settings, f"SELECT count() AS n FROM dead_letters WHERE position(payload, '{cid}') > 0") == [{"n": 0}]


def test_a_tenant_cannot_send_the_rollout_workers_score():
    # `rollout_score` weighs 1.0 by default, unbounded: from a tenant it would set any
    # reward it liked on any trajectory it names. Only the rollout worker publishes it.
    with pytest.raises(ItemError, match="body.name: rollout_score"):
        to_event(IngestItem.model_validate(item("evt-s", {"completion_id": "c", "name": ROLLOUT_SCORE,
                                                          "value": 1e6}, type="outcome")), "acme", utcnow())
    outcome = FeedbackEvent(event_id="e", tenant="acme", timestamp=utcnow(),
                            body=OutcomeBody(completion_id="c", name=ROLLOUT_SCORE, value=1e6))
    served = Trajectory(event_id="c", tenant="acme", completion_id="c", policy_version="v0", source="gateway",
                        prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[-1.0])
    rewarder = Rewarder(RewardConfigFile())
    assert rewarder.score(served, [outcome]).reward == 0.0  # and the stream ignores it on production traffic
    rollout = served.model_copy(update={"source": "rollout"})
    assert rewarder.score(rollout, [outcome.model_copy(update={"body": OutcomeBody(
        completion_id="c", name=ROLLOUT_SCORE, value=0.75)})]).reward == 0.75
