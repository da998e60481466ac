"""Components as processes: starting, serving, waiting for and stopping them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from liverl.settings import REPO_ROOT


def serve(app: FastAPI, host: str, port: int) -> None:
    # One worker: every component is a single process; scale-out is more processes.
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


def serve_beside(app: FastAPI, host: str, port: int, work: Callable[[threading.Event], None]) -> None:
    """A component whose work is a loop: its HTTP app (health, admin, metrics) on a thread
    beside it, and the loop until SIGTERM sets its stop event."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    work(stop)


def spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A component in its own session, so it outlives the command that started it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO_ROOT)


def yield_cpu(pid: int, nice: int) -> None:
    """Give a spawned component's whole session the niceness its process runs at.

    With Linux's autogroup scheduling (on by default on desktops and many VMs) each
    session competes for the CPU as one entity at the session's own nice, so a niced
    process in a session of its own takes a full share anyway: the ingest benchmark lost
    a third of its throughput to the "niced" stream that way.
    """
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        pass  # no autogroup here (or /proc is read-only, as in some containers): nice is all there is


def alive(pid: int) -> bool:
    """Running: a zombie (dead, not yet reaped by its parent) is not."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # the state is the field after the name, which ends at the last ')'
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc here: kill(0) is all there is


def answers(health: str, client: httpx.Client | None = None) -> bool:
    """Whether a component's health address answers: an http(s) URL with 200 (through
    `client`, if given: a client per call costs its SSL context), a tcp://host:port by
    accepting a connection."""
    if health.startswith("tcp://"):
        host, _, port = health[len("tcp://"):].rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
        except OSError:
            return False
        return True
    try:
        return (client.get(health, timeout=2) if client else httpx.get(health, timeout=2)).status_code == 200
    except httpx.HTTPError:
        return False


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


def wait_until(check: Callable[[], bool], timeout: float, process: subprocess.Popen | None = None,
               interval: float = 0.3) -> bool:
    """Poll check() until true; False on timeout or when `process` exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process is not None and process.poll() is not None:
            return False
        try:
            if check():
                return True
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(interval)
    return False
