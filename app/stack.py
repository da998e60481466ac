"""The embedded stack: start every component, check it is healthy, stop it after draining.

`up` starts the broker, the analytics sink (owner of chdb), the feedback stream, the
ingest API, the vLLM replicas, the gateway, the learner and the promotion controller,
in that order, each as its own process
with its log in `run/`. If any of them cannot start, everything already started is
stopped again and the error names the component and the fix.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from app.broker import BrokerSetupError, broker_command, broker_dir, cluster_id, store_command, store_health
from liverl.backlog import backlog_view
from liverl.contracts import Topics
from liverl.kafka import ensure_topics, group_lag
from liverl.keys import KeyStore, admin_headers, write_private
from liverl.lending import lending_state
from liverl.manifest import (
    Component,
    Manifest,
    manifest_file,
    read_manifest,
    settings_file,
    write_manifest,
)
from liverl.pool import ROLLOUT, Pool, read_pool, write_pool
from liverl.process import alive, answers, spawn, stop_pid, wait_until, yield_cpu
from liverl.settings import EmbeddedBroker, Settings
from policies.importer import import_version
from policies.registry import HELDOUT_REGRESSION, Registry
from serving.replicas import (
    ReplicaError,
    launch_replica,
    replica_healthy,
    replica_url,
    wait_replica,
)

# consumer group -> (the component that consumes for it, the topics it must finish)
DRAINED_GROUPS = {
    "liverl-feedback": ("feedback", (Topics.TRAJECTORIES, Topics.FEEDBACK)),
    "liverl-sink": ("sink", Topics.ALL),
}


# Every liverl component `up` starts, by the module it runs (compose.yaml runs the same).
COMPONENTS = {"sink": "feedback.sink", "feedback": "feedback.stream", "api": "ingest.api",
              "gateway": "serving.gateway", "learner": "learner.service", "controller": "promotion.api",
              "capacity": "serving.capacity", "rollouts": "rollouts.worker", "evaluator": "rollouts.evaluator",
              "supervisor": "app.supervisor"}


def stream_worker_name(index: int) -> str:
    return f"feedback-{index}" if index else "feedback"


def stream_workers(settings: Settings) -> list[str]:
    """The feedback stream's workers by component name (one consumer group)."""
    return [stream_worker_name(index) for index in range(settings.feedback.workers)]


def processes_of(settings: Settings, component: str) -> list[str]:
    """The processes that do `component`'s work by name: the stream's workers, or itself."""
    return stream_workers(settings) if component == "feedback" else [component]


class StackError(RuntimeError):
    """A component could not start or stop; the message names it and the fix."""


def child_env(settings: Settings) -> dict[str, str]:
    """The parent's settings, exactly, for every child process."""
    return dict(os.environ, PYTHONUNBUFFERED="1", **settings.environment())


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class Launcher:
    """Starts components, remembering them (and how to start each again, for the
    supervisor) so a failed start can stop them all."""

    def __init__(self, settings: Settings, say: Callable[[str], None] = print):
        self.settings = settings
        self.say = say
        self.started: list[Component] = []

    def log(self, name: str) -> Path:
        return self.settings.run_dir / f"{name}.log"

    def spawn(self, name: str, argv: list[str], health: str, url: str | None = None,
              env: dict[str, str] | None = None, nice: int | None = None) -> subprocess.Popen:
        component = Component(name=name, pid=0, url=url, log=str(self.log(name)), argv=argv, env=env or {},
                              health=health, nice=nice)
        process = start(self.settings, component)
        self.started.append(component)
        return process

    def wait(self, name: str, process: subprocess.Popen, health: str, timeout: float) -> None:
        if wait_until(lambda: answers(health), timeout, process):
            return
        if process.poll() is not None:
            lines = self.log(name).read_text(errors="replace").strip().splitlines()
            raise StackError(f"{name} exited at start (code {process.returncode}): "
                             f"{lines[-1] if lines else 'no output'}; see {self.log(name)}")
        raise StackError(f"{name} was not healthy after {timeout:.0f} s; see {self.log(name)}")

    def python(self, name: str, port: int, *args: str, background: bool = False, nice: int | None = None,
               module: str | None = None) -> None:
        """A liverl component (`module`: what runs, if not COMPONENTS[name]); `background` ones
        (the stream) run at `stream_nice`, on `stream_cpus`; others at `nice`, if given."""
        url = self.settings.url(port)
        module = module or COMPONENTS[name]
        argv = [sys.executable, "-m", module, *args]
        if background:
            nice = self.settings.stream_nice
            if self.settings.stream_cpus:
                argv = ["taskset", "-c", ",".join(map(str, self.settings.stream_cpus)), *argv]
        if nice is not None:
            argv = ["nice", "-n", str(nice), *argv]
        health = url + "/health"
        process = self.spawn(name, argv, health, url, nice=nice)
        self.wait(name, process, health, self.settings.start_timeout_s)
        self.say(f"  {name:<10} {url}")

    def stream_worker(self, index: int) -> None:
        """Stream worker `index` (0: "feedback"), on web port feedback + index."""
        port = self.settings.ports.feedback + index
        self.python(stream_worker_name(index), port, "--port", str(port), background=True,
                    module=COMPONENTS["feedback"])

    def broker(self) -> None:
        """The embedded broker (and, on disk, the store that keeps its topics)."""
        settings = self.settings
        assert isinstance(settings.broker, EmbeddedBroker)
        if settings.broker.storage == "disk":
            health = f"tcp://{settings.host}:{settings.broker.effective_store_port}"
            self.wait("broker-store", self.spawn("broker-store", store_command(settings), health), health, 30)
        argv, env = broker_command(settings, settings.broker_cluster_id or "")
        health = f"tcp://{settings.host}:{settings.broker.port}"
        self.wait("broker", self.spawn("broker", argv, health, settings.bootstrap, env), health, 30)
        where = f"topics in {broker_dir(settings)}" if settings.broker.storage == "disk" else "topics in memory"
        self.say(f"  broker     {settings.bootstrap} (cluster {settings.broker_cluster_id}, {where})")


def start(settings: Settings, component: Component, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `component` as its manifest entry says (`env`: added for this start only, a
    fault to inject, say), recording its new pid in the entry."""
    process = spawn(component.argv, dict(child_env(settings), **component.env, **(env or {})), Path(component.log))
    if component.nice is not None:
        yield_cpu(process.pid, component.nice)
    component.pid = process.pid
    return process


def check_ports(settings: Settings) -> None:
    ports = settings.ports
    wanted = {"ingest API": ports.api, "gateway": ports.gateway, "sink": ports.sink,
              "controller": ports.controller}
    wanted |= {name: ports.feedback + i for i, name in enumerate(stream_workers(settings))}
    if settings.capacity.enabled:
        wanted.update({"capacity scheduler": ports.capacity, "rollout worker": ports.rollouts})
        if settings.rollouts.heldout_every_s is not None:
            wanted["held-out evaluator"] = ports.evaluator
    if settings.serving.listen == "tcp":
        wanted.update({f"replica-{i}": ports.replica_base + i for i in range(settings.serving.replicas)})
    if settings.supervisor.enabled:
        wanted["supervisor"] = ports.supervisor
    if isinstance(settings.broker, EmbeddedBroker):
        wanted["broker"] = settings.broker.port
        if settings.broker.storage == "disk":
            wanted["broker store"] = settings.broker.effective_store_port
    for name, port in wanted.items():
        if not port_free(settings.host, port):
            raise StackError(
                f"{name}: port {port} is already taken; stop what uses it or choose another "
                f"(e.g. LIVERL_PORTS__... / --port-offset)"
            )


def ensure_dev_keys(settings: Settings) -> Path:
    """A development tenant key and an admin key on first start, kept in one 0600 file."""
    path = settings.dev_keys_file
    if not path.exists():
        store = KeyStore(settings.keys_file)
        tenant_key, _ = store.create("dev", "tenant", "development tenant key", ["feedback", "trajectories"])
        admin_key, _ = store.create("admin", "admin", "development admin key")
        write_private(path, json.dumps({"tenant": "dev", "tenant_key": tenant_key, "admin_key": admin_key}))
    return path


def starter_version(settings: Settings, progress: bool) -> tuple[str, Path]:
    """The registry's stable version; on first start, the starter policy becomes v0."""
    registry = Registry(settings.policies_dir)
    if stable := registry.stable():
        return stable.version, Path(stable.model_dir)
    source = settings.starter.model_dir
    if source is None:
        from policies.starter import build_starter_policy

        source = build_starter_policy(settings.starter.cache_dir, seed=settings.starter.seed,
                                      progress=progress)
    v0 = import_version(settings, Path(source), "liverl up")
    return v0.version, Path(v0.model_dir)


def running(settings: Settings) -> bool:
    """Whether a stack started in `settings.data_dir` still has a live component."""
    return (existing := read_manifest(settings)) is not None and any(alive(c.pid) for c in existing.components)


def wipe_data_dir(settings: Settings) -> None:
    """Remove `settings.data_dir` for a run from the starter; never under a live stack, whose
    manifest (the only record of its processes for `liverl down`) would go with it."""
    if running(settings):
        raise StackError(f"a stack is already running in {settings.data_dir}; `liverl down --data-dir "
                         f"{settings.data_dir}` stops it")
    shutil.rmtree(settings.data_dir, ignore_errors=True)


def up(settings: Settings, say: Callable[[str], None] = print, progress: bool = True) -> Manifest:
    if running(settings):
        raise StackError("the stack is already running; `liverl status` shows it, `liverl down` stops it")
    check_ports(settings)
    manifest_file(settings).unlink(missing_ok=True)  # a dead stack's: the supervisor must not revive it
    if not settings.serving.python.exists():
        raise StackError(f"replicas: serving environment missing at {settings.serving.python}; "
                         "run ./install.sh")
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    version, model_dir = starter_version(settings, progress)
    keys = ensure_dev_keys(settings)
    launcher = Launcher(settings, say)
    settings.broker_cluster_id = cluster_id(settings)
    settings_file(settings).write_text(settings.public_json())
    try:
        if isinstance(settings.broker, EmbeddedBroker):
            launcher.broker()
        asyncio.run(ensure_topics(settings))
        launcher.python("sink", settings.ports.sink, background=True)
        for index in range(settings.feedback.workers):
            launcher.stream_worker(index)
        launcher.python("api", settings.ports.api)
        started = [launch_replica(settings, f"replica-{i}", model_dir, replica_url(settings, i), version)
                   for i in range(settings.serving.replicas)]
        aliases = {**Registry(settings.policies_dir).aliases(), "stable": version}  # the teams' aliases too
        write_pool(settings, Pool(replicas=[r for r, _ in started], aliases=aliases))  # so a failure below stops them
        for replica, process in started:
            wait_replica(settings, replica, process)
            say(f"  {replica.name:<10} {replica.url} serving {version}")
        launcher.python("gateway", settings.ports.gateway)
        if settings.learner.enabled:
            launcher.python("learner", settings.ports.learner, nice=settings.learner.nice)
        launcher.python("controller", settings.ports.controller)
        if settings.capacity.enabled:
            launcher.python("rollouts", settings.ports.rollouts, nice=settings.rollouts.nice)
            launcher.python("capacity", settings.ports.capacity)
            if settings.rollouts.heldout_every_s is not None:
                launcher.python("evaluator", settings.ports.evaluator, nice=settings.rollouts.heldout_nice)
        if settings.supervisor.enabled:
            launcher.python("supervisor", settings.ports.supervisor)
    except (StackError, ReplicaError, BrokerSetupError, OSError) as error:
        stop_all(settings, launcher.started)
        raise StackError(str(error)) from None
    except BaseException:
        stop_all(settings, launcher.started)
        raise
    manifest = Manifest(cluster_id=settings.broker_cluster_id, started_at=time.time(), components=launcher.started)
    write_manifest(settings, manifest)
    say(f"  keys       {keys}")
    say(f"  dashboard  {settings.url(settings.ports.controller)}/dashboard (log in with the admin key in {keys.name})")
    return manifest


def restart(settings: Settings, name: str, reason: str, env: dict[str, str] | None = None,
            wait_s: float = 120.0) -> dict:
    """`name` stopped and started again (`env` added for this start only) by the supervisor,
    the stack's one restarter; the supervisor itself, or any component when it is off, here."""
    manifest = read_manifest(settings)
    if manifest is None:
        raise StackError(f"no stack is running in {settings.data_dir}; `liverl up` starts one")
    if name == "supervisor" or not settings.supervisor.enabled:
        return restart_here(settings, manifest, name, env or {}, wait_s)
    try:
        response = httpx.post(f"{settings.url(settings.ports.supervisor)}/restart/{name}",
                              json={"reason": reason, "env": env or {}, "wait_s": wait_s},
                              headers=admin_headers(settings), timeout=wait_s + 60)
    except httpx.HTTPError as error:
        raise StackError(f"the supervisor did not answer ({error!r}); `liverl restart supervisor` "
                         "starts it again") from None
    if response.status_code == 404:
        raise StackError(response.json()["detail"])
    response.raise_for_status()
    return response.json()


def restart_here(settings: Settings, manifest: Manifest, name: str, env: dict[str, str], wait_s: float) -> dict:
    component = next((c for c in manifest.components if c.name == name), None)
    if component is None:
        raise StackError(f"no component {name!r} in the running stack; it has "
                         f"{[c.name for c in manifest.components]}")
    stop_pid(component.pid)
    process = start(settings, component, env)
    component.restarts += 1
    component.state = "running"
    write_manifest(settings, manifest)
    healthy = wait_until(lambda: answers(component.health or ""), wait_s, process) if component.health else True
    return {"name": name, "pid": component.pid, "restarts": component.restarts, "healthy": healthy}


def stop_all(settings: Settings, components: list[Component]) -> None:
    """Stop components newest first, and every replica in the pool (those a swap is
    starting too)."""
    for component in reversed(components):
        stop_pid(component.pid, timeout=10)
    pool = read_pool(settings)
    for replica in pool.replicas + pool.starting:
        if replica.pid:
            stop_pid(replica.pid, timeout=10)
    write_pool(settings, Pool())


def drain(settings: Settings, timeout: float, say: Callable[[str], None]) -> None:
    """Wait until every acknowledged event is joined, stored and consumed."""
    groups = dict(DRAINED_GROUPS)
    if settings.learner.enabled:
        groups["liverl-learner"] = ("learner", (Topics.SAMPLES,))
    manifest = read_manifest(settings)
    pids = {c.name: c.pid for c in manifest.components} if manifest else {}
    deadline = time.time() + timeout
    held: list[dict] = []  # successive readings where only incomplete groups hold the learner back
    while True:
        lags = {g: asyncio.run(group_lag(settings, g, topics)) for g, (_, topics) in groups.items()}
        if not any(lags.values()):
            return
        if only_open_groups_left(settings, lags, held):
            say(f"  drained; {held[-1]['open_groups']} incomplete rollout groups hold "
                f"{lags['liverl-learner']} learner offsets back: read again, whole, at the next start")
            return
        for group, (component, _) in groups.items():
            workers = [name for name in processes_of(settings, component) if name in pids]
            if lags[group] and workers and not any(alive(pids[name]) for name in workers):
                raise StackError(f"{component} died with {lags[group]} events unprocessed; "
                                 f"see {settings.run_dir / (component + '.log')} and `liverl up` again")
        if settings.learner.enabled and not lags["liverl-feedback"]:
            # Every sample is out: the learner learns from what it still holds.
            try:
                httpx.post(settings.url(settings.ports.learner) + "/flush", params={"reason": "liverl down drains"},
                           headers=admin_headers(settings), timeout=10)
            except httpx.HTTPError as error:
                if "learner" in pids and not alive(pids["learner"]):
                    raise StackError(f"learner died before the drain ended; see {settings.run_dir / 'learner.log'}"
                                     " and `liverl up` again (its uncommitted samples are read again)") from error
                say(f"  the learner did not answer /flush ({error!r}); asking again")
        if time.time() > deadline:
            raise StackError(f"drain timed out with lag {lags}; rerun `liverl down` or use --force")
        say(f"  draining: {lags}")
        time.sleep(1.0)


SOURCES = ("gateway", "api", "rollouts", "capacity")  # where new events come from: production and rollouts


def stop_sources(settings: Settings, names: tuple[str, ...] = SOURCES) -> None:
    """Stop the components among `names`: by default those new events come from, so a
    drain can end. The supervisor first, or it would start them again as dead (and a
    drain fed by restarted rollouts would never end): the stack is on its way down."""
    manifest = read_manifest(settings)
    stopping = [c for c in manifest.components if c.name in ("supervisor", *names)] if manifest else []
    for component in sorted(stopping, key=lambda c: c.name != "supervisor"):
        stop_pid(component.pid)


def only_open_groups_left(settings: Settings, lags: dict[str, int], held: list[dict]) -> bool:
    """Whether the learner's lag is all held by groups still missing members (nothing else
    lags, nothing pending, the lag unchanged over three readings): waiting cannot end it,
    and nothing is lost, since uncommitted offsets are read again."""
    if not settings.learner.enabled or any(lag for g, lag in lags.items() if g != "liverl-learner"):
        held.clear()
        return False
    try:
        health = httpx.get(settings.url(settings.ports.learner) + "/health", timeout=5).json()
    except httpx.HTTPError:
        return False
    reading = {"lag": lags["liverl-learner"], "pending": health.get("pending"),
               "open_groups": health.get("open_groups", 0)}
    if reading["pending"] or not reading["open_groups"] or (held and held[-1] != reading):
        held.clear()
    if reading["open_groups"] and not reading["pending"]:
        held.append(reading)
    return len(held) >= 3


def down(settings: Settings, say: Callable[[str], None] = print, force: bool = False) -> None:
    manifest = read_manifest(settings)
    if manifest is None:
        say("nothing to stop")
        return
    by_name = {c.name: c for c in manifest.components}
    # New traffic first (the supervisor before it); then everything in flight is drained;
    # then the rest.
    stop_sources(settings)
    if not force and "broker" in by_name and alive(by_name["broker"].pid):
        drain(settings, settings.drain_timeout_s, say)
    stop_all(settings, manifest.components)
    manifest_file(settings).unlink()
    say("  stopped")


def status(settings: Settings) -> dict:
    manifest = read_manifest(settings)
    if manifest is None:
        return {"running": False, "components": []}
    rows = []
    for c in manifest.components:
        rows.append(dict(c.model_dump(exclude={"argv", "env", "nice"}), healthy=component_healthy(c)))
    pool = read_pool(settings)
    for r in pool.replicas:
        rows.append(dict(name=r.name, pid=r.pid, url=r.url, log=None, policy_version=r.policy_version,
                         role="lent to rollouts" if r.alias == ROLLOUT else (f"alias {r.alias}" if r.alias
                                                                             else "production"),
                         healthy=bool(r.pid and alive(r.pid) and replica_healthy(r.url) and r.enabled)))
    for r in pool.starting:
        rows.append(dict(name=r.name, pid=r.pid, url=r.url, log=None, policy_version=r.policy_version,
                         role="starting (blue/green swap)", healthy=False))
    return {"running": True, "cluster_id": manifest.cluster_id,
            "keys_file": str(settings.data_dir / "dev-keys.json"), "components": rows,
            "lending": lending_state(settings), "broker_store": store_health(settings),
            "backlog": backlog_view(settings),
            "heldout": heldout_status(Registry(settings.policies_dir))}


def heldout_status(registry: Registry, latest: int = 5) -> list[dict]:
    """The held-out evaluator's latest figures, one row per version scored, and whether the
    held-out watch found it had lost held-out skill."""
    regressed = {e["version"] for e in registry.history() if e["to"] == HELDOUT_REGRESSION}
    scored = [v for v in registry.versions() if "pass_rate" in (v.metrics.get("heldout") or {})]
    return [{"version": v.version, "state": v.state, "pass_rate": v.metrics["heldout"]["pass_rate"],
             "tasks": v.metrics["heldout"]["tasks"], "lost_skill": v.version in regressed}
            for v in scored[-latest:]]


def component_healthy(component: Component) -> bool:
    return alive(component.pid) and (component.health is None or answers(component.health))
