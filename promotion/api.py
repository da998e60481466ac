"""The promotion controller's process (`python -m promotion.api`): its decision loop
(`promotion/controller.py`) beside this HTTP API: health, on-call's API (an admin key, or
the dashboard's session) and the dashboard. The `liverl policy` commands over HTTP, each
taking the controller's lock so it never interleaves with the controller's own moves."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import httpx
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from pydantic import BaseModel, Field

from liverl.audit import AuditLog, Reason
from liverl.contracts import AliasName, VersionName
from liverl.http import Audit, service_app
from liverl.keys import KeyRecord, admin_headers
from liverl.lending import hold_lending
from liverl.pool import read_pool
from liverl.process import serve_beside
from liverl.settings import Settings
from policies.importer import import_version
from policies.registry import REJECTED, AliasMove, Pin, PolicyVersion
from promotion.controller import Controller
from promotion.dashboard import Operator, mount_dashboard
from promotion.reports import ReportError, SinkError, diff, history, served_at

T = TypeVar("T")


class RollbackRequest(Reason):
    to: str | None = Field(None, description="The version to put back (default: the previous stable one).")


class ImportRequest(Reason):
    model_dir: Path = Field(description="A Hugging Face model directory on the controller's host.")


class AliasRequest(Reason):
    version: VersionName | None = Field(description="The version the alias names; null removes the alias.")


class PolicyDetail(BaseModel):
    version: PolicyVersion
    history: list[dict] = Field(description="Every state change: version, at, from, to, actor, reason.")


class Analysis(BaseModel):
    version: str
    state: str
    verdict: str | None = Field(description="The guard's latest verdict; None for a version it never judged.")
    seconds: float | None = Field(description="How long it had been judged at that verdict.")
    comparisons: list[dict] = Field(description="Canary against stable per metric (and tenants found worse).")
    serving: list[dict] = Field(description="Canary against stable on server errors and p99 latency.")
    tenants: list[dict] = Field(description="Each tenant with enough traffic, on its own.")
    passed: bool = Field(description="It reached stable.")
    failed: bool = Field(description="It was found worse or taken off users.")


def the_controller(request: Request) -> Controller:
    return request.app.state.controller


Running = Annotated[Controller, Depends(the_controller)]
router = APIRouter()


def health(controller: Running) -> dict:
    registry = controller.registry
    canary = registry.in_state("canary")
    stable = registry.stable()
    pin = registry.pinned()
    return {"ok": True, "state": controller.state, "last_error": controller.last_error,
            "stable": stable.version if stable else None,
            "canary": canary[-1].version if canary else None, "pinned": pin is not None}


def act(controller: Controller, audit: AuditLog, key: KeyRecord, action: str, target: str, reason: str,
        change: Callable[[], T]) -> T:
    """One change by on-call: under the lock, refused with the reason when illegal, audited."""
    with controller.lock:
        try:
            result = change()
        except KeyError as error:
            raise HTTPException(404, error.args[0]) from None
        except ValueError as error:  # IllegalTransition included: the message says what is allowed
            raise HTTPException(409, str(error)) from None
        except RuntimeError as error:  # a swap that failed verification: replicas are back on stable
            raise HTTPException(502, str(error)) from None
    audit.record(key.key_id, action, target, reason)
    return result


def report(answer: Callable[[], T]) -> T:
    try:
        return answer()
    except KeyError as error:
        raise HTTPException(404, error.args[0]) from None
    except ReportError as error:
        raise HTTPException(422, str(error)) from None
    except SinkError as error:
        raise HTTPException(503, str(error)) from None


@router.get("/admin/policies")
def policies(controller: Running, key: Operator) -> list[PolicyVersion]:
    return controller.registry.versions()


@router.get("/admin/policies/{version}")
def policy(version: str, controller: Running, key: Operator) -> PolicyDetail:
    try:
        return PolicyDetail(version=controller.registry.get(version), history=controller.registry.history(version))
    except KeyError as error:
        raise HTTPException(404, error.args[0]) from None


@router.get("/admin/analysis/{version}")
def analysis(version: str, controller: Running, key: Operator) -> Analysis:
    """The live guard's latest look at a version, shaped for an Argo Rollouts `web`
    metric (docs/production.md): `verdict` is continue, non_inferior, worse, held or
    inconclusive; `passed` / `failed` are the success and failure conditions."""
    try:
        record = controller.registry.get(version)
    except KeyError as error:
        raise HTTPException(404, error.args[0]) from None
    info = record.metrics.get("canary") or {}
    verdict = info.get("verdict", "continue" if record.state in ("candidate", "canary") else None)
    return Analysis(version=version, state=record.state, verdict=verdict, seconds=info.get("seconds"),
                    comparisons=info.get("comparisons", []), tenants=info.get("tenants", []),
                    serving=info.get("serving", []),
                    passed=record.state == "stable", failed=record.state in REJECTED or verdict == "worse")


@router.post("/admin/policies/{version}/promote")
def promote(version: str, body: Reason, controller: Running, audit: Audit, key: Operator) -> PolicyVersion:
    """Canary then every replica, each verified; returns when it serves everywhere."""
    return act(controller, audit, key, "policy.promote", version, body.reason,
               lambda: controller.promoter.promote(version, key.key_id, body.reason))


@router.post("/admin/policies/{version}/abort")
def abort(version: str, body: Reason, controller: Running, audit: Audit, key: Operator) -> PolicyVersion:
    """Take a canary off users: stable back on its replica (verified), the learner rewinds."""
    return act(controller, audit, key, "policy.abort", version, body.reason,
               lambda: controller.promoter.abort(version, key.key_id, body.reason))


@router.post("/admin/rollback")
def rollback(body: RollbackRequest, controller: Running, audit: Audit, key: Operator) -> PolicyVersion:
    """The previous stable (or `to`) back on every replica; returns once verified serving."""
    return act(controller, audit, key, "policy.rollback", body.to or "previous stable", body.reason,
               lambda: controller.promoter.rollback(key.key_id, body.reason, to=body.to))


@router.get("/admin/history")
def full_history(controller: Running, key: Operator, version: VersionName | None = None) -> list[dict]:
    """Every state change, oldest first (with every pin and alias move when no version is named)."""
    return report(lambda: history(controller.registry, version))


@router.get("/admin/served")
def served(controller: Running, key: Operator, tenant: str = Query(max_length=64),
           at: datetime = Query(description="When (UTC if naive)."),
           window_s: float = Query(60.0, gt=0, le=86_400)) -> dict:
    """Which versions answered `tenant` within `window_s` of `at`, and what was stable and canary then."""
    return report(lambda: served_at(controller.settings, tenant, at, window_s))


@router.get("/admin/diff/{a}/{b}")
def compare_versions(a: str, b: str, controller: Running, key: Operator,
                     kl_completions: int = Query(64, ge=0, le=1024)) -> dict:
    """Two versions side by side (`liverl policy diff`)."""
    return report(lambda: diff(controller.settings, a, b, kl_completions))


@router.post("/admin/policies/import")
def import_policy(body: ImportRequest, controller: Running, audit: Audit, key: Operator) -> PolicyVersion:
    """A model directory on this host in as a version: stable if it is the first, else a candidate."""
    return act(controller, audit, key, "policy.import", str(body.model_dir), body.reason,
               lambda: import_version(controller.settings, body.model_dir, key.key_id))


def learner_call(settings: Settings, method: str, path: str, **kwargs) -> dict:
    try:
        response = httpx.request(method, settings.url(settings.ports.learner) + path, timeout=620,
                                 headers=admin_headers(settings), **kwargs)
    except httpx.HTTPError as error:
        raise HTTPException(503, f"the learner is not answering: {type(error).__name__}") from None
    response.raise_for_status()
    return response.json()


@router.get("/admin/learner")
def learner_status(controller: Running, key: Operator) -> dict:
    """The learner's /health: its version, backlog, pause, dropped samples."""
    return learner_call(controller.settings, "GET", "/health")


@router.post("/admin/learner/{verb}")
def learner_control(verb: Literal["pause", "resume"], body: Reason, controller: Running, audit: Audit,
                    key: Operator) -> dict:
    """Pause or resume learning (pause answers once the step in flight is done)."""
    answer = learner_call(controller.settings, "POST", f"/{verb}", params={"reason": body.reason})
    audit.record(key.key_id, f"learner.{verb}", "learner", body.reason, via="controller")
    return answer


@router.post("/admin/capacity/{verb}")
def lending_control(verb: Literal["pause", "resume"], body: Reason, controller: Running, audit: Audit,
                    key: Operator) -> dict:
    """Pause or resume lending to rollouts, as `liverl capacity pause|resume` (the
    dashboard's door to it): a pause answers once no replica is lent, or after 30 s."""
    return hold_lending(controller.settings, audit, key.key_id, verb, body.reason, 30.0, via="controller")


@router.get("/admin/aliases")
def aliases(controller: Running, key: Operator) -> dict[str, str]:
    """Every alias the gateway routes by (`x-liverl-alias`): stable, canary and the teams' own."""
    return read_pool(controller.settings).aliases


@router.post("/admin/aliases/{alias}")
def move_alias(alias: AliasName, body: AliasRequest, controller: Running, audit: Audit, key: Operator) -> AliasMove:
    """Point a team's alias at a version, or remove it (`version` null)."""
    return act(controller, audit, key, "policy.alias", alias, body.reason,
               lambda: controller.promoter.move_alias(alias, body.version, key.key_id, body.reason))


@router.post("/admin/pin")
def pin(body: Reason, controller: Running, audit: Audit, key: Operator) -> Pin:
    """No automatic promotion moves stable until unpinned (a worse canary is still aborted)."""
    return act(controller, audit, key, "policy.pin", "stable", body.reason,
               lambda: controller.registry.pin("stable", key.key_id, body.reason))


@router.post("/admin/unpin")
def unpin(body: Reason, controller: Running, audit: Audit, key: Operator) -> Pin:
    return act(controller, audit, key, "policy.unpin", "stable", body.reason,
               lambda: controller.registry.pin("stable", key.key_id, body.reason, pinned=False))


def create_app(controller: Controller) -> FastAPI:
    app = service_app("liverl promotion controller", controller.settings, health)
    app.state.controller = controller
    mount_dashboard(app, controller, app.state.audit)
    app.include_router(router)
    return app


def serve_controller(settings: Settings) -> None:
    controller = Controller(settings)
    serve_beside(create_app(controller), settings.host, settings.ports.controller, controller.run)


if __name__ == "__main__":  # the controller's process: its decision loop beside this API
    from liverl.settings import get_settings

    serve_controller(get_settings())
