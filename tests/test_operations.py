"""On-call's controls on the shared stack, through the promotion controller's admin API
and the `liverl policy` commands: only admin keys, always a reason, only legal moves, a
pin that holds automatic promotion, and a rollback under load that drops no request."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from helpers import serving_load, wait_for
from typer.testing import CliRunner

from app.cli import app
from liverl.keys import admin_headers, admin_key, hash_key
from liverl.pool import read_pool
from policies.registry import Registry
from promotion.promoter import Promoter
from promotion.sequential import wilson


@pytest.fixture()
def controller(settings, stack) -> httpx.Client:
    with httpx.Client(base_url=settings.url(settings.ports.controller), timeout=600,
                      headers=admin_headers(settings)) as client:
        yield client


def publish_copy(settings, registry: Registry, name: str):
    """A candidate with stable's weights that passed the gate: promotable, verifiable."""
    stable = registry.stable()
    staged = settings.policies_dir / f"staging-{name}"
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(stable.model_dir, staged)
    return registry.publish(staged, parent=stable.version, window=None, sample_ids=[], actor="test",
                            metrics={"gate": {"passed": True, "reason": "test candidate"}})


def test_no_admin_endpoint_answers_a_tenant_key_or_no_key(settings, dev_keys, controller):
    spec = controller.get("/openapi.json").json()
    calls = [(method, path.replace("{version}", "v0")) for path, methods in spec["paths"].items()
             if path.startswith("/admin") for method in methods]
    assert len(calls) >= 8
    for method, path in calls:
        for headers, refused in (({"Authorization": f"Bearer {dev_keys['tenant_key']}"}, 403), ({}, 401)):
            response = httpx.request(method, controller.base_url.join(path), headers=headers,
                                     json={"reason": "trying"}, timeout=30)
            assert response.status_code == refused, (method, path, response.text)


def test_every_change_needs_a_reason_and_an_illegal_one_says_what_is_allowed(controller, settings, paused_learner):
    stable = Registry(settings.policies_dir).stable().version
    for path in ("/admin/pin", f"/admin/policies/{stable}/abort", "/admin/rollback"):
        for body in ({}, {"reason": "   "}):
            response = controller.post(path, json=body)
            assert response.status_code == 422 and "reason" in response.text, (path, body)
    refused = controller.post(f"/admin/policies/{stable}/abort", json={"reason": "on-call thinks it is bad"})
    assert refused.status_code == 409
    assert f"{stable} is stable; it cannot become aborted" in refused.json()["detail"]
    assert "superseded, rolled_back" in refused.json()["detail"]
    analysis = controller.get(f"/admin/analysis/{stable}").json()
    assert analysis["state"] == "stable" and analysis["passed"] and not analysis["failed"]
    missing = controller.post("/admin/policies/v99999/promote", json={"reason": "typo"})
    assert missing.status_code == 404 and "v99999" in missing.json()["detail"]
    # On-call compares two versions side by side.
    diff = CliRunner().invoke(app, ["policy", "diff", "v0", stable, "--json", "--data-dir", str(settings.data_dir)])
    assert diff.exit_code == 0, diff.output
    figures = json.loads(diff.output)["versions"]
    assert set(figures) == {"v0", stable} and figures[stable]["state"] == "stable"
    for live in (t for f in figures.values() for t in f["tenants"].values()):
        assert live["served"] > 0 and 0 <= live["accept_ci"][0] <= live["accept_ci"][1] <= 1
    # The CLI says the same, and needs --reason before it calls anything.
    result = CliRunner().invoke(app, ["policy", "abort", stable, "--reason", "bad", "--data-dir", str(settings.data_dir)])
    assert result.exit_code == 1 and "cannot become aborted" in result.output
    assert CliRunner().invoke(app, ["policy", "pin", "--data-dir", str(settings.data_dir)]).exit_code == 2


def test_a_pinned_stable_holds_until_unpinned(settings, controller, paused_learner):
    registry = Registry(settings.policies_dir)
    stable = registry.stable()
    pin = controller.post("/admin/pin", json={"reason": "incident 42: hold what serves"})
    assert pin.status_code == 200 and pin.json()["version"] == stable.version
    candidate = publish_copy(settings, registry, "pinned")
    try:
        wait_for(lambda: "pinned" in controller.get("/health").json()["state"], timeout=30)
        for _ in range(3):  # several looks of the controller, and still nothing moves
            wait_for(lambda: "pinned" in controller.get("/health").json()["state"], timeout=30)
            assert registry.get(candidate.version).state == "candidate"
    finally:
        unpin = controller.post("/admin/unpin", json={"reason": "incident 42 closed"})
    assert unpin.status_code == 200 and not unpin.json()["pinned"]
    # The test stack promotes on the offline gate alone: unpinned, the candidate goes out.
    wait_for(lambda: registry.get(candidate.version).state == "stable", timeout=180)
    history = json.loads(CliRunner().invoke(app, ["policy", "history", "--json", "--data-dir",
                                                  str(settings.data_dir)]).output)
    pins = [(h["to"], h["reason"]) for h in history if h["to"] in ("pinned", "unpinned")][-2:]
    assert pins == [("pinned", "incident 42: hold what serves"), ("unpinned", "incident 42 closed")]
    assert all(h["actor"] for h in history)


def test_rollback_through_the_api_under_load_drops_nothing_and_serves_everywhere(
        settings, dev_keys, controller, paused_learner):
    registry = Registry(settings.policies_dir)
    promoted = controller.post(f"/admin/policies/{publish_copy(settings, registry, 'rollback').version}/promote",
                               json={"reason": "a stable to roll back from"})
    assert promoted.status_code == 200 and promoted.json()["state"] == "stable", promoted.text
    current = registry.stable()
    # On-call holds stable first, so nothing is promoted on top of the rollback meanwhile.
    assert controller.post("/admin/pin", json={"reason": "investigating complaints"}).status_code == 200
    with serving_load(settings, dev_keys["tenant_key"]) as statuses:
        response = controller.post("/admin/rollback", json={"reason": "users complain about the new one"})
    assert response.status_code == 200, response.text
    restored = response.json()
    assert set(statuses) == {200}
    assert restored["state"] == "stable" and restored["version"] != current.version
    # Returned only once verified serving on every replica.
    assert {r.policy_version for r in read_pool(settings).replicas} == {restored["version"]}
    assert registry.get(current.version).state == "rolled_back"
    last = registry.history(current.version)[-1]
    assert last["reason"] == "users complain about the new one"
    assert last["actor"] == hash_key(admin_key(settings))[:12]  # the key that asked
    # Which version served the load's tenant just now, from ClickHouse's request log.
    now = (datetime.now(timezone.utc) + timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%S")  # after it, whole s

    def served_now() -> dict | None:
        result = CliRunner().invoke(app, ["policy", "history", "--tenant", "dev", "--at", now, "--json",
                                          "--data-dir", str(settings.data_dir)])
        answer = json.loads(result.output)
        return answer if restored["version"] in {r["policy_version"] for r in answer["served"]} else None

    try:
        answer = wait_for(served_now, timeout=90, interval=3)
    finally:
        controller.post("/admin/unpin", json={"reason": "rollback done"})
    assert answer["stable"] == [restored["version"]] and answer["canary"] == []


def test_a_canary_takes_its_share_of_sessions_and_each_session_keeps_its_version(
        settings, dev_keys, paused_learner):
    registry = Registry(settings.policies_dir)
    stable = registry.stable()
    candidate = publish_copy(settings, registry, "share")
    promoter = Promoter(settings, registry)
    assert promoter.start_canary(candidate.version, "test", "traffic share test").state == "canary"
    try:
        with httpx.Client(base_url=settings.url(settings.ports.gateway), timeout=120,
                          headers={"Authorization": f"Bearer {dev_keys['tenant_key']}"}) as gateway:

            def version_for(session: str) -> str:
                response = gateway.post("/v1/completions", headers={"x-liverl-session": session},
                                        json={"model": "liverl", "prompt": "x = ", "max_tokens": 1})
                assert response.status_code == 200, response.text
                return response.headers["x-liverl-policy-version"]

            first = {f"user-{i}": version_for(f"user-{i}") for i in range(200)}
            assert set(first.values()) == {stable.version, candidate.version}
            low, high = wilson(sum(v == candidate.version for v in first.values()), len(first), z=2.576)
            assert low <= settings.serving.canary_share <= high
            for session in list(first)[:25]:  # a session never flips between versions
                assert version_for(session) == first[session]
    finally:
        promoter.abort(candidate.version, "test", "traffic share test over")
    assert {r.policy_version for r in read_pool(settings).replicas} == {stable.version}
    assert read_pool(settings).aliases == {"stable": stable.version}
