"""The supervisor keeps the stack running: a component that dies is started again with
backoff, each restart counted (manifest, audit log); one that keeps dying is left down and
on-call alerted; `liverl restart` goes through it. Real processes, no stack."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

from fastapi.testclient import TestClient
from helpers import alert_receiver, wait_for

from app.stack import start, stop_sources
from app.supervisor import Supervisor, create_app
from liverl.audit import AuditLog
from liverl.keys import KeyStore
from liverl.manifest import Component, Manifest, read_manifest, write_manifest
from liverl.process import alive, stop_pid
from liverl.settings import PromotionConfig, Settings, SupervisorConfig


def python_component(settings: Settings, name: str, code: str) -> Component:
    component = Component(name=name, pid=0, log=str(settings.run_dir / f"{name}.log"),
                          argv=[sys.executable, "-c", code])
    start(settings, component)
    return component


def by_name(settings: Settings) -> dict[str, Component]:
    return {c.name: c for c in read_manifest(settings).components}


def test_a_dead_component_is_restarted_with_backoff_and_one_that_keeps_dying_is_left_down(tmp_path):
    alerts, webhook = alert_receiver()
    settings = Settings(data_dir=tmp_path, supervisor=SupervisorConfig(poll_s=0.05, backoff_s=0.3, max_restarts=3),
                        promotion=PromotionConfig(alert_webhook=f"http://127.0.0.1:{webhook.server_port}/alerts"))
    settings.run_dir.mkdir(parents=True)
    steady = python_component(settings, "steady", "import time; time.sleep(120)")
    flaky = python_component(settings, "flaky", "import time, os; time.sleep(float(os.environ.get('LIVE', 0.2)))")
    write_manifest(settings, Manifest(cluster_id="c", started_at=0, components=[steady, flaky]))
    supervisor, stop = Supervisor(settings), threading.Event()
    thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: by_name(settings)["flaky"].state == "down", timeout=30)
        components = by_name(settings)
        assert components["flaky"].restarts == 3  # the fourth death within the window: left down
        assert components["steady"].restarts == 0 and components["steady"].pid == steady.pid
        restarts = [e.at for e in AuditLog(settings.audit_file).entries(action="component.restart")]
        gaps = [b - a for a, b in zip(restarts, restarts[1:], strict=False)]
        assert len(restarts) == 3 and gaps[1] > gaps[0] + 0.2  # backoff doubles: 0.3, 0.6, 1.2 s
        down = AuditLog(settings.audit_file).entries(action="component.down")
        assert [e.target for e in down] == ["flaky"] and "liverl restart flaky" in down[0].reason
        alert = wait_for(lambda: alerts and alerts[0], timeout=10)
        assert alert["event"] == "component_down" and alert["component"] == "flaky"
        time.sleep(0.5)
        assert by_name(settings)["flaky"].restarts == 3  # left down: not started again

        # `liverl restart` revives it, with the environment given for that start only.
        admin, _ = KeyStore(settings.keys_file).create("ops", "admin", "on-call")
        with TestClient(create_app(supervisor)) as client:
            refused = client.post("/restart/flaky", json={"reason": "fixed"})
            assert refused.status_code == 401
            headers = {"Authorization": f"Bearer {admin}"}
            assert client.post("/restart/nope", json={"reason": "x"}, headers=headers).status_code == 404
            answer = client.post("/restart/flaky", json={"reason": "fixed the config", "env": {"LIVE": "60"},
                                                         "wait_s": 5}, headers=headers)
        assert answer.status_code == 200, answer.text
        revived = answer.json()
        assert revived["restarts"] == 4 and revived["healthy"] and alive(revived["pid"])
        wait_for(lambda: by_name(settings)["flaky"].state == "running", timeout=10)
        entry = AuditLog(settings.audit_file).entries(action="component.restart")[-1]
        assert entry.details["cause"] == "requested" and entry.details["env"] == ["LIVE"]
        assert "fixed the config" in entry.reason
    finally:
        stop.set()
        thread.join(timeout=10)
        webhook.shutdown()
        for component in read_manifest(settings).components:
            stop_pid(component.pid, timeout=2)


STUCK = """
import http.server, sys
class Stuck(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # alive, and answering that it is not well (a consumer task died inside)
        self.send_response(503)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Stuck).serve_forever()
"""


def test_a_live_component_whose_health_check_keeps_failing_is_restarted(tmp_path):
    settings = Settings(data_dir=tmp_path, start_timeout_s=0.5,
                        supervisor=SupervisorConfig(poll_s=0.05, health_every_s=0.1, unhealthy_after_s=0.5))
    settings.run_dir.mkdir(parents=True)
    port = free_port()
    stuck = Component(name="stuck", pid=0, log=str(settings.run_dir / "stuck.log"),
                      argv=[sys.executable, "-c", STUCK, str(port)], health=f"http://127.0.0.1:{port}/health")
    start(settings, stuck)
    write_manifest(settings, Manifest(cluster_id="c", started_at=time.time(), components=[stuck]))
    supervisor, stop = Supervisor(settings), threading.Event()
    thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: by_name(settings)["stuck"].restarts >= 1, timeout=30)
        assert not alive(stuck.pid)
        stopped = AuditLog(settings.audit_file).entries(action="component.stuck")
        assert stopped and stopped[0].target == "stuck" and "unhealthy" in stopped[0].reason
    finally:
        stop.set()
        thread.join(timeout=10)
        stop_pid(by_name(settings)["stuck"].pid, timeout=2)


SUPERVISE = """import sys, threading
from pathlib import Path
from app.supervisor import Supervisor
from liverl.settings import Settings, SupervisorConfig
config = SupervisorConfig(poll_s=0.05, backoff_s=0.1)
supervisor = Supervisor(Settings(data_dir=Path(sys.argv[1]), supervisor=config))
print("looking", flush=True)
supervisor.run(threading.Event())"""


def test_what_is_stopped_for_a_drain_stays_stopped(tmp_path):
    """The demo stops the rollouts before its drain (a trough at the end would feed the drain
    for ever): the supervisor, a process of the stack, must not start them again as dead."""
    settings = Settings(data_dir=tmp_path)
    settings.run_dir.mkdir(parents=True)
    rollouts = python_component(settings, "rollouts", "import time; time.sleep(120)")
    supervisor = Component(name="supervisor", pid=0, log=str(settings.run_dir / "supervisor.log"),
                           argv=[sys.executable, "-c", SUPERVISE, str(tmp_path)])
    start(settings, supervisor)
    write_manifest(settings, Manifest(cluster_id="c", started_at=time.time(), components=[rollouts, supervisor]))
    try:
        # Up and looking (its imports take seconds on a busy machine), so that on the old code
        # it would have restarted the rollouts within the two seconds below.
        wait_for(lambda: "looking" in Path(supervisor.log).read_text(), timeout=60)
        assert alive(supervisor.pid)
        stop_sources(settings, ("rollouts",))
        time.sleep(2)  # many looks and backoffs
        assert by_name(settings)["rollouts"].restarts == 0 and not alive(by_name(settings)["rollouts"].pid)
        assert not alive(supervisor.pid)  # stopped first: the stack is on its way down
    finally:
        for component in by_name(settings).values():
            stop_pid(component.pid, timeout=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
