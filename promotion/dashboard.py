"""On-call's dashboard, served by the promotion controller at `/dashboard`.

One page: versions and their states, what serves where (aliases, the canary's traffic
share, each replica), lending to rollouts (paused or not, the latest lends and
take-backs), reward and accept rate per version over time with intervals
(SVG drawn here from ClickHouse's figures), the learner's progress, sync, and the audit
history; promote, abort, pin, rollback and pause/resume lending buttons call the same
admin API, with the same checks, and each asks for a reason. It refreshes itself.

Login is the admin key, once: it becomes a signed session cookie (HttpOnly, SameSite
Strict) that names the key, so revoking the key ends every session made with it. A
change asked through a session also carries the session's CSRF token in a header,
which a page from another origin can neither read nor send. Nothing comes from the
internet: the page, its script and its plots are all served by this process.
"""

from __future__ import annotations

import io
import os
import secrets
import time
from pathlib import Path
from typing import Annotated, Protocol

import httpx
from fastapi import APIRouter, Depends, Form, Header, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from itsdangerous import BadSignature, URLSafeTimedSerializer

from liverl.audit import AuditLog
from liverl.backlog import backlog_view
from liverl.http import Audit
from liverl.keys import KeyRecord, KeyStore, require_admin, require_key
from liverl.lending import lending_state, scheduler_answers
from liverl.pool import read_pool
from liverl.settings import Settings
from policies.registry import Registry
from promotion.sequential import wilson

HERE = Path(__file__).parent
SESSION_COOKIE = "liverl_session"
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
templates = Jinja2Templates(directory=HERE / "templates")


def skill_cell(metrics: dict) -> str:
    """A version's held-out pass rate and the skill guard's verdict, e.g. "0.235 non_inferior"."""
    figures, verdict = metrics.get("heldout") or {}, (metrics.get("skill") or {}).get("verdict", "")
    rate = f"{figures['pass_rate']:.3f}" if "pass_rate" in figures else ""
    return f"{rate} {verdict}".strip()


def session_secret(settings: Settings) -> bytes:
    """The key that signs session cookies: made once per deployment, kept 0600 beside the
    key store, so sessions survive a controller restart."""
    path = settings.data_dir / "dashboard-secret"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    with os.fdopen(fd, "wb") as out:
        out.write(secrets.token_bytes(32))
    return path.read_bytes()


class Sessions:
    """Signed cookies `{key id, csrf token}`; the key is looked up again on every request."""

    def __init__(self, settings: Settings, keys: KeyStore):
        self.keys = keys
        self.max_age = settings.promotion.dashboard_session_s
        self.signer = URLSafeTimedSerializer(session_secret(settings), salt="liverl-dashboard")

    def open(self, record: KeyRecord) -> str:
        return self.signer.dumps({"key": record.key_id, "csrf": secrets.token_urlsafe(24)})

    def read(self, cookie: str | None) -> tuple[KeyRecord, str] | None:
        """The admin key behind a cookie and the session's CSRF token; None when the cookie
        is missing, forged, expired, or its key was revoked or is no admin's."""
        if not cookie:
            return None
        try:
            # Whole seconds, as itsdangerous counts a signature's age: the same expiry.
            session = self.signer.loads(cookie, max_age=int(self.max_age))
        except BadSignature:
            return None
        record = self.keys.get(session["key"])
        return (record, session["csrf"]) if record and record.role == "admin" else None


async def operator(request: Request, authorization: Annotated[str | None, Header()] = None,
                   csrf: Annotated[str | None, Header(alias=CSRF_HEADER)] = None) -> KeyRecord:
    """An admin: by key (`Authorization: Bearer`, as scripts and the CLI call), or by the
    dashboard's session cookie, whose changes must also carry its CSRF token."""
    if authorization is not None:  # the same checks as every other admin door
        return await require_admin(await require_key(authorization, request.app.state.keys))
    session = request.app.state.sessions.read(request.cookies.get(SESSION_COOKIE))
    if session is None:
        raise HTTPException(401, "missing API key: send 'Authorization: Bearer <key>', or log in at /dashboard")
    record, token = session
    if request.method not in SAFE_METHODS and not secrets.compare_digest(csrf or "", token):
        raise HTTPException(403, f"missing or wrong {CSRF_HEADER} header for this session")
    return record


Operator = Annotated[KeyRecord, Depends(operator)]


class ControllerView(Protocol):
    """What the dashboard reads of the promotion controller."""

    settings: Settings
    registry: Registry
    state: str
    last_error: str | None

    def figure_rows(self, versions: list[str], since: float, until: float,
                    bucket_s: int | None = None) -> list[dict]: ...


# The page and its session: the admin key in, a session cookie out.
session_router = APIRouter(prefix="/dashboard", tags=["dashboard"])


@session_router.get("/login", response_class=HTMLResponse, include_in_schema=False)
def login_page(request: Request) -> HTMLResponse:
    return templates.TemplateResponse(request, "login.html", {"error": None})


@session_router.post("/login", response_class=HTMLResponse)
def login(request: Request, key: Annotated[str, Form(max_length=200)], audit: Audit) -> Response:
    """The admin key, once: answered with a session cookie and the dashboard."""
    record = request.app.state.keys.authenticate(key.strip())
    if record is None or record.role != "admin":
        error = "invalid or revoked key" if record is None else "the dashboard needs an admin key"
        return templates.TemplateResponse(request, "login.html", {"error": error},
                                          status_code=401 if record is None else 403)
    audit.record(record.key_id, "dashboard.login", "dashboard")
    sessions = request.app.state.sessions
    page = RedirectResponse("/dashboard", status_code=303)
    page.set_cookie(SESSION_COOKIE, sessions.open(record), max_age=int(sessions.max_age),
                    httponly=True, samesite="strict", secure=request.url.scheme == "https", path="/")
    return page


@session_router.post("/logout", include_in_schema=False)
def logout() -> Response:
    """Forget the session here (a plain form: being logged out by another site harms nothing)."""
    page = RedirectResponse("/dashboard/login", status_code=303)
    page.delete_cookie(SESSION_COOKIE, path="/")
    return page


@session_router.get("", response_class=HTMLResponse, include_in_schema=False)
async def page(request: Request) -> Response:
    session = request.app.state.sessions.read(request.cookies.get(SESSION_COOKIE))
    if session is None:
        if request.headers.get("authorization"):
            await operator(request, request.headers["authorization"])  # a key: 401/403 say why
        return RedirectResponse("/dashboard/login", status_code=303)
    record, token = session
    return templates.TemplateResponse(request, "dashboard.html", {"csrf": token, "key_id": record.key_id,
                                                                  "csrf_header": CSRF_HEADER})


def learner_health(settings: Settings, registry: Registry) -> dict:
    """The learner's /health, and how many versions it is ahead of stable."""
    try:
        learner = httpx.get(settings.url(settings.ports.learner) + "/health", timeout=3).json()
    except httpx.HTTPError as error:
        return {"error": f"learner not answering: {type(error).__name__}"}
    stable = registry.stable()
    if stable and "version" in learner and (seq := registry.seq_of(learner["version"])) is not None:
        learner["versions_ahead_of_stable"] = seq - stable.seq
    return learner


def page_state(controller: ControllerView, audit: AuditLog) -> dict:
    """Everything the page shows but the plots, as one JSON document."""
    settings, registry = controller.settings, controller.registry
    pool = read_pool(settings)
    pin = registry.pinned()
    try:
        lending = lending_state(settings) | {"scheduler": scheduler_answers(settings)}
    except (OSError, ValueError) as error:  # the rest of the page is still on-call's
        lending = {"error": f"lending's records unreadable: {error!r}"}
    return {
        "controller": {"state": controller.state, "last_error": controller.last_error,
                       "pinned": pin.model_dump(mode="json") if pin else None},
        "versions": [{"version": v.version, "state": v.state, "parent": v.parent, "created_at": v.created_at,
                      "gate": (v.metrics.get("gate") or {}).get("passed"),
                      "verdict": (v.metrics.get("canary") or {}).get("verdict"), "skill": skill_cell(v.metrics)}
                     for v in registry.versions()[-30:][::-1]],
        "serving": {"aliases": pool.aliases, "canary_share": settings.serving.canary_share,
                    "replicas": [{"name": r.name, "version": r.policy_version, "enabled": r.enabled,
                                  "alias": r.alias, "in_sync": r.policy_version in pool.aliases.values()}
                                 for r in pool.replicas]},
        "lending": lending,
        "learner": learner_health(settings, registry),
        "backlog": backlog_view(settings),
        "history": registry.history()[-30:][::-1],
        "audit": [e.model_dump(mode="json") for e in reversed(audit.entries(limit=30))],
    }


def dashboard_router(controller: ControllerView, audit: AuditLog) -> APIRouter:
    """What the page reads: the controller's state and the plots."""
    router = APIRouter(prefix="/dashboard", tags=["dashboard"])

    @router.get("/state")
    def state(key: Operator) -> dict:
        """Everything the page shows but the plots, as one JSON document."""
        return page_state(controller, audit)

    @router.get("/plots/rates.svg", response_class=Response, responses={200: {"content": {"image/svg+xml": {}}}})
    def rates_plot(key: Operator, minutes: Annotated[int, Query(ge=1, le=7 * 24 * 60)] = 30,
                   tenant: Annotated[str | None, Query(max_length=64)] = None) -> Response:
        """Accept rate (95% Wilson interval) and mean reward (95% normal interval) per
        version over the last `minutes`, judged production completions, all tenants or one."""
        until = time.time()
        bucket_s = max(10, minutes * 60 // 40)
        names = [v.version for v in controller.registry.versions()[-32:]]
        try:
            rows = controller.figure_rows(names, until - minutes * 60, until, bucket_s) if names else []
        except httpx.HTTPError as error:
            raise HTTPException(503, f"the sink's figures are not available: {type(error).__name__}") from None
        if tenant is not None:
            rows = [r for r in rows if r["tenant"] == tenant]
        return Response(rates_svg(rows, bucket_s, minutes), media_type="image/svg+xml")

    return router


def rates_svg(rows: list[dict], bucket_s: int, minutes: int) -> str:
    """The plot as inline SVG. Text stays text (the page and its test can read the
    legend); each line's group is id'd `accept-<version>` / `reward-<version>`."""
    from matplotlib import rc_context

    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "liverl"}):
        out = io.StringIO()
        rates_figure(rows, bucket_s, minutes, time.time()).savefig(out, format="svg")
    text = out.getvalue()
    return text[text.index("<svg"):]  # inline in the page: no XML prolog


def rates_figure(rows: list[dict], bucket_s: int, minutes: int, now: float):
    """Two panels, a line per version with its interval as a band, against minutes before `now`."""
    from matplotlib.figure import Figure

    series: dict[str, dict[int, list[float]]] = {}  # version -> bucket -> judged, accepted, n, sum, squares
    for row in rows:
        cell = series.setdefault(row["policy_version"], {}).setdefault(row["bucket"], [0, 0, 0, 0.0, 0.0])
        for i, name in enumerate(("judged", "accepted", "samples", "reward_sum", "reward_squares")):
            cell[i] += row[name]
    figure = Figure(figsize=(9, 5.2), layout="constrained")
    accept_axes, reward_axes = figure.subplots(2, 1, sharex=True)

    def ago(t: int) -> float:  # the middle of what a bucket covers so far (the newest is still open), in minutes
        return ((t + min(t + bucket_s, now)) / 2 - now) / 60

    for version, buckets in sorted(series.items(), key=lambda kv: min(kv[1])):
        times = sorted(buckets)
        x = [ago(t) for t in times]
        judged = [(t, buckets[t]) for t in times if buckets[t][0]]
        if judged:
            xj = [ago(t) for t, _ in judged]
            bands = [wilson(int(c[1]), int(c[0])) for _, c in judged]
            (line,) = accept_axes.plot(xj, [c[1] / c[0] for _, c in judged], marker=".", label=version)
            line.set_gid(f"accept-{version}")
            accept_axes.fill_between(xj, [b[0] for b in bands], [b[1] for b in bands], alpha=0.2,
                                     color=line.get_color())
        means = [buckets[t][3] / buckets[t][2] for t in times]
        half = [1.96 * max(buckets[t][4] / buckets[t][2] - m * m, 0.0) ** 0.5 / buckets[t][2] ** 0.5
                for t, m in zip(times, means, strict=True)]
        (line,) = reward_axes.plot(x, means, marker=".", label=version)
        line.set_gid(f"reward-{version}")
        reward_axes.fill_between(x, [m - h for m, h in zip(means, half, strict=True)],
                                 [m + h for m, h in zip(means, half, strict=True)],
                                 alpha=0.2, color=line.get_color())
    accept_axes.set_ylabel("accept rate")
    accept_axes.set_ylim(0, 1)
    reward_axes.set_ylabel("mean reward")
    reward_axes.set_xlabel("minutes from now (judged production completions)")
    reward_axes.set_xlim(-minutes, 0)
    if series:
        accept_axes.legend(loc="upper left", fontsize="small", ncols=4)
    else:
        accept_axes.text(0.5, 0.5, "no judged completions in this period", ha="center",
                         transform=accept_axes.transAxes)
    return figure


def mount_dashboard(app, controller: ControllerView, audit: AuditLog) -> None:
    app.state.sessions = Sessions(controller.settings, app.state.keys)
    app.include_router(session_router)
    app.include_router(dashboard_router(controller, audit))
    app.mount("/dashboard/static", StaticFiles(directory=HERE / "static"), name="dashboard-static")
