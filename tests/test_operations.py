"""On-call's controls on the shared stack, through the promotion controller's admin API
and the `liverl policy` commands: only admin keys, always a reason, only legal moves, a
pin that holds automatic promotion, and a rollback under load that drops no request."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from helpers import serve_and_judge, serving_load, sql, stable_pinned, wait_for
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


def promote_copy(settings, name: str, reason: str) -> httpx.Response:
    """A copy of stable promoted by an operator through the API. Published under a pin, or
    the controller's own look may promote it first and the operator's call finds it stable
    already (409: CI, Nov 29)."""
    with stable_pinned(settings, f"the test promotes {name} itself") as registry:
        candidate = publish_copy(settings, registry, name)
        return httpx.post(f"{settings.url(settings.ports.controller)}/admin/policies/{candidate.version}/promote",
                          headers=admin_headers(settings), json={"reason": reason}, timeout=600)


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


def test_every_change_needs_a_reason_and_an_illegal_one_says_what_is_allowed(controller, settings, dev_keys,
                                                                              paused_learner):
    stable = Registry(settings.policies_dir).stable().version
    serve_and_judge(settings, dev_keys["tenant_key"], 6)  # logged traffic to compare the versions on
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
    wait_for(lambda: sql(settings, f"SELECT count() AS n FROM trajectories WHERE policy_version = '{stable}'")[0]["n"])
    diff = CliRunner().invoke(app, ["policy", "diff", "v0", stable, "--json", "--data-dir", str(settings.data_dir)])
    assert diff.exit_code == 0, diff.output
    answer = json.loads(diff.output)
    figures, kl = answer["versions"], answer["kl_on_logged"]
    assert (kl["completions"] > 0 and kl["value"] >= 0) or "retention" in kl["why"], kl
    assert set(figures) == {"v0", stable} and figures[stable]["state"] == "stable"
    for live in (t for f in figures.values() for t in f["tenants"].values()):
        assert live["served"] > 0 and 0 <= live["accept_ci"][0] <= live["accept_ci"][1] <= 1
    # The CLI says the same, and needs --reason before it calls anything.
    result = CliRunner().invoke(app, ["policy", "abort", stable, "--reason", "bad",
                                      "--data-dir", str(settings.data_dir)])
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
    promoted = promote_copy(settings, "rollback", "a stable to roll back from")
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
    now = (datetime.now(UTC) + timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%S")  # after it, whole s

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
    # Pinned, the controller neither takes the candidate first nor promotes the canary.
    with stable_pinned(settings, "the test starts its own canary") as registry:
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


def test_a_team_alias_routes_requests_to_the_version_it_names(settings, dev_keys, controller, paused_learner):
    registry = Registry(settings.policies_dir)
    stable = registry.stable().version
    served = {r.policy_version for r in read_pool(settings).replicas}
    elsewhere = next(v.version for v in registry.versions() if v.version not in served)
    gateway = httpx.Client(base_url=settings.url(settings.ports.gateway), timeout=120,
                           headers={"Authorization": f"Bearer {dev_keys['tenant_key']}"})

    def ask(alias: str) -> httpx.Response:
        return gateway.post("/v1/completions", headers={"x-liverl-alias": alias},
                            json={"model": "liverl", "prompt": "def f():\n", "max_tokens": 4})

    try:
        for alias, version in (("champion", stable), ("challenger", elsewhere)):
            moved = controller.post(f"/admin/aliases/{alias}", json={"version": version, "reason": f"our {alias}"})
            assert moved.status_code == 200 and moved.json()["version"] == version, moved.text
        assert {"stable": stable, "champion": stable, "challenger": elsewhere}.items() <= controller.get(
            "/admin/aliases").json().items()
        answer = ask("champion")
        assert answer.status_code == 200 and answer.headers["x-liverl-policy-version"] == stable
        refused = ask("challenger")
        assert refused.status_code == 409 and f"names {elsewhere}, which no replica serves" in refused.text
        assert ask("nobody").status_code == 404 and "champion" in ask("nobody").text
        assert ask("Not An Alias").status_code == 400
        lifecycle = controller.post("/admin/aliases/stable", json={"version": elsewhere, "reason": "shortcut"})
        assert lifecycle.status_code == 409 and "promote, abort or roll back" in lifecycle.text
    finally:
        for alias in ("champion", "challenger"):
            controller.post(f"/admin/aliases/{alias}", json={"version": None, "reason": "test over"})
        gateway.close()
    assert "champion" not in controller.get("/admin/aliases").json()
    history = json.loads(CliRunner().invoke(app, ["policy", "history", "--json", "--data-dir",
                                                  str(settings.data_dir)]).output)
    moves = [(h["to"], h["reason"]) for h in history if h["to"].startswith("alias champion")]
    assert moves[-2:] == [("alias champion", "our champion"), ("alias champion removed", "test over")]


def test_replicas_started_elsewhere_join_only_with_the_right_weights(settings, starter_dir, controller, paused_learner):
    registry = Registry(settings.policies_dir)
    stable = registry.stable()
    first = read_pool(settings).replicas[0]
    other = next((v for v in reversed(registry.versions()) if v.content_hash != stable.content_hash
                  and (Path(v.model_dir) / "config.json").exists()), None)

    def cli(*args: str):
        return CliRunner().invoke(app, [*args, "--data-dir", str(settings.data_dir)])

    try:
        if other is not None:  # a replica that answers, but with other weights, is refused
            refused = cli("replica", "add", "extra", first.url, "--version", other.version, "--reason", "scale out")
            assert refused.exit_code == 1, refused.output
            assert f"does not serve {other.version}'s weights" in " ".join(refused.output.split())  # rich wraps
        added = cli("replica", "add", "extra", first.url, "--reason", "scale out")
        assert added.exit_code == 0 and f"serves {stable.version}" in " ".join(added.output.split()), added.output
        assert [r.policy_version for r in read_pool(settings).replicas if r.name == "extra"] == [stable.version]
        assert cli("replica", "add", "extra", first.url, "--reason", "again").exit_code == 1
        unknown = cli("replica", "add", "team", first.url, "--alias", "nobody", "--reason", "bake-off")
        assert unknown.exit_code == 1 and "no team alias 'nobody'" in unknown.output
    finally:
        removed = cli("replica", "remove", "extra", "--reason", "scaled in")
    assert removed.exit_code == 0 and "extra" not in {r.name for r in read_pool(settings).replicas}
    # A base model comes in as a version; with a stable one already, as a candidate for on-call.
    imported = cli("policy", "import", str(starter_dir), "--reason", "new base model", "--json")
    assert imported.exit_code == 0, imported.output
    version = json.loads(imported.output)
    assert version["state"] == "candidate" and version["content_hash"] == registry.get(version["version"]).content_hash
    assert cli("policy", "import", str(settings.data_dir), "--reason", "oops").exit_code == 1


def test_the_last_replica_serving_stable_is_never_removed(tmp_path):
    from liverl.pool import Pool, Replica, write_pool
    from liverl.settings import Settings

    settings = Settings(data_dir=tmp_path)
    write_pool(settings, Pool(replicas=[Replica(name="only", url="http://127.0.0.1:1", policy_version="v3",
                                                model_dir=str(tmp_path))], aliases={"stable": "v3"}))
    result = CliRunner().invoke(app, ["replica", "remove", "only", "--reason", "tidy", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1 and "last replica serving stable (v3)" in result.output
    assert [r.name for r in read_pool(settings).replicas] == ["only"]


def test_every_policy_and_learner_command_has_its_admin_endpoint(settings, controller, paused_learner):
    stable = Registry(settings.policies_dir).stable().version

    def cli_json(*args: str):
        result = CliRunner().invoke(app, [*args, "--json", "--data-dir", str(settings.data_dir)])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    over_http = controller.get(f"/admin/diff/v0/{stable}", params={"kl_completions": 8}).json()
    assert over_http == cli_json("policy", "diff", "v0", stable, "--kl-completions", "8")
    assert controller.get("/admin/diff/v0/v99999").status_code == 404
    assert [(h["version"], h["to"], h["reason"]) for h in controller.get("/admin/history").json()] == [
        (h["version"], h["to"], h["reason"]) for h in cli_json("policy", "history")]
    now = datetime.now(UTC).replace(microsecond=0).isoformat()
    served = controller.get("/admin/served", params={"tenant": "dev", "at": now}).json()
    assert served["stable"] == [stable] and served == cli_json("policy", "history", "--tenant", "dev", "--at",
                                                               now.split("+")[0])
    assert controller.get("/admin/served", params={"tenant": "dev'--", "at": now}).status_code == 422
    assert controller.get("/admin/learner").json()["paused"] is True
    for verb, paused in (("resume", False), ("pause", True)):
        answer = controller.post(f"/admin/learner/{verb}", json={"reason": f"{verb} through the controller"})
        assert answer.status_code == 200 and answer.json()["paused"] is paused
    assert controller.post("/admin/learner/pause", json={}).status_code == 422  # a reason, always
