"""Keeps the stack running: a component that dies is started again, with backoff; one that
keeps dying is left down and on-call is alerted, rather than restarted in a loop.

`liverl up` starts it last, as a process of its own; `liverl down` stops it first, so it
never starts again what `down` stops. It is the only restarter of the stack's processes:
`liverl restart NAME` asks it (POST /restart/NAME), so two restarters never race. The
vLLM replicas are not its own: the promotion controller owns them (it repairs a replica
a dead swap left behind), and a second owner would race it.

Each restart is counted in the manifest (`liverl status`), in a metric and in the audit
log; the time from a death seen to healthy again is a histogram (docs/reliability.md).
Its process also runs the backlog watch (app/backlog_watch.py).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Annotated

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, Field

from app.backlog_watch import BacklogWatch
from app.stack import start
from liverl.audit import AuditLog, Reason
from liverl.http import service_app
from liverl.keys import KeyRecord, require_admin
from liverl.manifest import Component, read_manifest, write_manifest
from liverl.observability import log, setup_logging
from liverl.process import alive, answers, serve_beside, stop_pid, wait_until
from liverl.settings import Settings

logger = setup_logging("supervisor")
ACTOR = "supervisor"

RESTARTS = Counter("liverl_supervisor_restarts_total", "Components started again", ["component", "cause"])
LEFT_DOWN = Gauge("liverl_supervisor_components_down", "Components left down after dying too often")
RECOVERY = Histogram("liverl_supervisor_recovery_seconds", "From a death seen to healthy again", ["component"],
                     buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300))


class Supervisor:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.config = settings.supervisor
        self.audit = AuditLog(settings.audit_file)
        self.lock = threading.Lock()  # one restarter: the loop and the restart endpoint take turns
        self.deaths: dict[str, list[float]] = defaultdict(list)  # within window_s
        self.due: dict[str, float] = {}  # dead components: when their backoff ends
        self.dead_since: dict[str, float] = {}  # not healthy again yet: since when
        self.children: list[subprocess.Popen] = []  # what it started, reaped when they die
        self.started: dict[str, float] = {}  # when each was last (re)started: health has grace after
        self.unhealthy_since: dict[str, float] = {}
        self.next_health_check = 0.0
        self.http = httpx.Client()
        self.backlog = BacklogWatch(settings, lambda stage, reason: self.alert("backlog_old", stage, reason),
                                    lambda name, reason: self.restart_now(name, reason, {}))

    def run(self, stop: threading.Event) -> None:
        threading.Thread(target=self.backlog.run, args=(stop,), name="backlog-watch", daemon=True).start()
        while not stop.wait(self.config.poll_s):
            with self.lock:
                self.look()

    def look(self) -> None:
        self.children = [p for p in self.children if p.poll() is None]
        manifest = read_manifest(self.settings)
        if manifest is None:
            return
        now, changed = time.time(), False
        check_health = now >= self.next_health_check
        if check_health:
            self.next_health_check = now + self.config.health_every_s
        for component in manifest.components:
            if component.name == ACTOR or component.state == "down":
                continue
            if alive(component.pid):
                changed |= self.check_recovered(component, now)
                if check_health:
                    self.check_stuck(component, now, manifest.started_at)
            elif component.name not in self.due:
                self.died(component, now)
                changed = True
            elif now >= self.due[component.name]:
                del self.due[component.name]
                self.restart(component, "died", f"died; restart {len(self.deaths[component.name])}")
                changed = True
        if changed:
            write_manifest(self.settings, manifest)

    def check_recovered(self, component: Component, now: float) -> bool:
        since = self.dead_since.get(component.name)
        if since is None or (component.health and not answers(component.health, self.http)):
            return False
        RECOVERY.labels(component.name).observe(now - since)
        log(logger, "recovered", component=component.name, seconds=round(now - since, 2), pid=component.pid)
        del self.dead_since[component.name]
        component.state = "running"
        return True

    def check_stuck(self, component: Component, now: float, stack_started: float) -> None:
        """Stop a live component whose health check has failed for `unhealthy_after_s` (a
        consumer task that died inside a live process, say); the next look restarts it."""
        if not component.health or now - self.started.get(component.name, stack_started) < \
                self.settings.start_timeout_s or answers(component.health, self.http):
            self.unhealthy_since.pop(component.name, None)
            return
        since = self.unhealthy_since.setdefault(component.name, now)
        if now - since >= self.config.unhealthy_after_s:
            log(logger, "stuck", component=component.name, pid=component.pid, unhealthy_s=round(now - since, 1))
            self.audit.record(ACTOR, "component.stuck", component.name,
                              f"alive but unhealthy for {now - since:.0f} s: stopped, to be restarted")
            stop_pid(component.pid, timeout=10)
            del self.unhealthy_since[component.name]

    def died(self, component: Component, now: float) -> None:
        deaths = [t for t in self.deaths[component.name] if now - t < self.config.window_s] + [now]
        self.deaths[component.name] = deaths
        self.dead_since.setdefault(component.name, now)
        if len(deaths) > self.config.max_restarts:
            component.state = "down"
            LEFT_DOWN.inc()
            reason = (f"died {len(deaths)} times in {self.config.window_s:.0f} s; left down: see "
                      f"{component.log}, then `liverl restart {component.name}`")
            self.audit.record(ACTOR, "component.down", component.name, reason, deaths=len(deaths))
            self.alert("component_down", component.name, reason)
            return
        backoff = min(self.config.backoff_s * 2 ** (len(deaths) - 1), self.config.max_backoff_s)
        self.due[component.name] = now + backoff
        component.state = "restarting"
        log(logger, "died", component=component.name, pid=component.pid, deaths=len(deaths), backoff_s=backoff)

    def restart(self, component: Component, cause: str, reason: str, env: dict[str, str] | None = None) -> None:
        self.children.append(start(self.settings, component, env))
        self.started[component.name] = time.time()
        component.restarts += 1
        RESTARTS.labels(component.name, cause).inc()
        self.audit.record(ACTOR, "component.restart", component.name, reason, cause=cause, pid=component.pid,
                          restarts=component.restarts, env=sorted(env or {}))
        log(logger, "restarted", component=component.name, cause=cause, pid=component.pid)

    def restart_now(self, name: str, reason: str, env: dict[str, str]) -> Component:
        """Stop `name` (if alive) and start it again, `env` added for this start only; a
        component left down is given its chances again."""
        with self.lock:
            manifest = read_manifest(self.settings)
            components = manifest.components if manifest else []
            component = next((c for c in components if c.name == name and name != ACTOR), None)
            if manifest is None or component is None:
                names = [c.name for c in components if c.name != ACTOR]
                raise HTTPException(404, f"no component {name!r} in the running stack; it has {names}")
            stop_pid(component.pid)
            if component.state == "down":
                LEFT_DOWN.dec()
            self.deaths.pop(name, None)
            self.due.pop(name, None)
            self.dead_since[name] = time.time()
            component.state = "restarting"
            self.restart(component, "requested", reason, env)
            write_manifest(self.settings, manifest)
            return component

    def alert(self, event: str, component: str, reason: str) -> None:
        """Tell on-call, as the promotion controller does (payload in docs/production.md);
        a webhook that fails is logged, never retried into the loop."""
        log(logger, "alert", alert=event, component=component, reason=reason)
        webhook = self.settings.promotion.alert_webhook
        if webhook is None:
            return
        payload = {"event": event, "component": component, "version": None, "reason": reason,
                   "at": datetime.now(UTC).isoformat(), "actor": ACTOR}
        try:
            httpx.post(str(webhook), json=payload, timeout=self.settings.promotion.alert_timeout_s).raise_for_status()
        except httpx.HTTPError as error:
            log(logger, "alert not delivered", component=component, error=repr(error))


class RestartRequest(Reason):
    env: dict[str, str] = Field(default_factory=dict, description="Environment added for this start only "
                                "(e.g. LIVERL_FAULT for a fault test); a later restart after a death goes without.")
    wait_s: float = Field(120.0, ge=0, le=600, description="How long to wait for it to be healthy before answering.")


class Restarted(BaseModel):
    name: str
    pid: int
    restarts: int
    healthy: bool = Field(description="Whether it answered its health check within wait_s.")


def supervisor(request: Request) -> Supervisor:
    return request.app.state.supervisor


Running = Annotated[Supervisor, Depends(supervisor)]


def create_app(sup: Supervisor) -> FastAPI:
    app = service_app("liverl supervisor", sup.settings)
    app.state.supervisor = sup

    @app.post("/restart/{name}")
    def restart(name: str, body: RestartRequest, sup: Running,
                key: Annotated[KeyRecord, Depends(require_admin)]) -> Restarted:
        """Stop the component and start it again (the supervisor's own restart, so it never
        races a restart after a death)."""
        component = sup.restart_now(name, f"{key.key_id}: {body.reason}", body.env)
        healthy = wait_until(lambda: answers(component.health or ""), body.wait_s,
                             interval=0.2) if component.health else alive(component.pid)
        return Restarted(name=name, pid=component.pid, restarts=component.restarts, healthy=healthy)

    return app


if __name__ == "__main__":
    from liverl.settings import get_settings

    settings = get_settings()
    sup = Supervisor(settings)
    serve_beside(create_app(sup), settings.host, settings.ports.supervisor, sup.run)
