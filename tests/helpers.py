"""Small helpers the integration tests share."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from app.stack import restart
from liverl.contracts import Topics
from liverl.kafka import read_topic
from liverl.keys import admin_headers
from liverl.settings import Settings
from policies.registry import Registry


def sql(settings: Settings, query: str) -> list[dict]:
    response = httpx.post(settings.url(settings.ports.sink) + "/sql", headers=admin_headers(settings),
                          json={"sql": query, "format": "json"}, timeout=30)
    response.raise_for_status()
    return response.json()["data"]


# The machine CI runs on is shared, and at times about half as fast as the one the waits were
# set on (Nov 29: the suite took 51 min there, 29 for the same commit an hour later, and engines
# 2-3 times as long to start): every wait allows for that. A condition met early returns at once,
# so a passing run loses nothing.
SLOW_MACHINE = 2.0


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.3):
    """Poll until predicate returns something truthy; return it (or fail after timeout, on
    a machine SLOW_MACHINE times slower)."""
    deadline = time.time() + timeout * SLOW_MACHINE
    while time.time() < deadline:
        if result := predicate():
            return result
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout * SLOW_MACHINE} s")


def alert_receiver() -> tuple[list[dict], ThreadingHTTPServer]:
    """A webhook endpoint on a free port that keeps every alert POSTed to it."""
    alerts: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            alerts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return alerts, server


def learner_health(settings) -> dict | None:
    """The learner's /health, or None while it is (re)starting."""
    try:
        return httpx.get(settings.url(settings.ports.learner) + "/health", timeout=5).json()
    except httpx.TransportError:
        return None


def learner_consuming(settings) -> dict | None:
    """The learner's /health once the consumer group has given it partitions: a learner
    stopped in the middle of joining would hold its successor's join for an hour."""
    health = learner_health(settings)
    return health if health and health["partitions"] else None


def controller_health(settings) -> dict:
    """The promotion controller's /health: what it did at its last look."""
    return httpx.get(settings.url(settings.ports.controller) + "/health", timeout=5).json()


@contextmanager
def stable_pinned(settings, reason: str) -> Iterator[Registry]:
    """While the block runs the controller promotes nothing and moves no replica onto
    stable: pinned, and waited for until its /health says so, so a look that began
    before the pin has ended. An operator's own promote still goes through."""
    registry = Registry(settings.policies_dir)
    registry.pin("stable", "test", reason)
    try:
        wait_for(lambda: controller_health(settings)["state"].startswith("stable pinned"), timeout=120)
        yield registry
    finally:
        registry.pin("stable", "test", f"done: {reason}", pinned=False)


def controller_idle(settings) -> bool:
    """No promotion in flight: the controller has no canary and nothing to take. Its
    /health tells what it did at its last poll; a candidate the learner published since
    (a pause answers after the step in flight is published) is in the registry only."""
    try:
        health = controller_health(settings)
    except httpx.TransportError:
        return False
    registry = Registry(settings.policies_dir)
    stable = registry.stable()
    waiting = [c for c in registry.in_state("candidate") if (stable is None or c.seq > stable.seq)
               and (c.metrics.get("gate") or {}).get("passed")]
    return health["canary"] is None and health["state"].startswith(("idle", "v")) and not waiting


def item(event_id: str, body: dict, type: str = "feedback") -> dict:
    return {"id": event_id, "type": type, "timestamp": "2026-11-22T12:00:00Z", "body": body}


def restart_component(settings: Settings, name: str, env: dict[str, str]) -> int:
    """Stop one of the stack's components and start it again with `env` added to its
    environment for this start (a fault to inject, a setting to change), through the
    supervisor as `liverl restart` does; answering again when this returns."""
    restarted = restart(settings, name, "test restart", env)
    assert restarted["healthy"], f"{name} was not healthy again after its restart: {restarted}"
    return restarted["pid"]


@contextmanager
def serving_load(settings: Settings, tenant_key: str, clients: int = 3) -> Iterator[list[int]]:
    """`clients` users sending completions through the gateway without pause while the
    block runs; yields the status code of every answer so far (after at least five)."""
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {tenant_key}"}) as client:
            while not stop.is_set():
                r = client.post(settings.url(settings.ports.gateway) + "/v1/completions",
                                json={"model": "liverl", "prompt": "def f():\n", "max_tokens": 16})
                statuses.append(r.status_code)

    threads = [threading.Thread(target=load) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(statuses) > 5)
        yield statuses
        before_end = len(statuses)
        wait_for(lambda: len(statuses) > before_end + 5)  # still served after the change
    finally:
        stop.set()
        for t in threads:
            t.join()


def serve_and_judge(settings, key: str, n: int) -> str:
    """`n` completions through the gateway, each accepted or rejected by its user; the
    version that served them."""
    headers = {"Authorization": f"Bearer {key}"}
    served = set()
    with httpx.Client(timeout=60, headers=headers) as client:
        for i in range(n):
            response = client.post(settings.url(settings.ports.gateway) + "/v1/completions",
                                   json={"prompt": "def add(a, b):\n", "max_tokens": 12, "temperature": 1.0})
            assert response.status_code == 200, response.text
            served.add(response.headers["x-liverl-policy-version"])
            verdict = "accept" if i % 3 else "reject"
            client.post(settings.url(settings.ports.api) + "/v1/ingestion", json={"batch": [item(
                f"f-{uuid.uuid4().hex}", {"kind": verdict, "completion_id": response.json()["completion_id"]})]})
    assert len(served) == 1, served
    return served.pop()


# The feedback stream's tests: what goes in through the ingest API, what comes out on the topics.
def read_all(settings, topic: str) -> list[dict]:
    """Every message on `topic`, parsed."""
    return [json.loads(value) for value in read_topic(settings, topic, timeout_s=300)]


def outcomes(settings, run: str) -> tuple[list[dict], list[dict]]:
    """This run's samples and the dead letters of its feedback, as sent."""
    samples = [s for s in read_all(settings, Topics.SAMPLES) if run in s["sample_id"]]
    letters = [d for d in read_all(settings, Topics.DEAD_LETTER) if run in d["payload"]]
    return samples, letters


def ingest(client: httpx.Client, items: list[dict], timeout: float = 60) -> None:
    """Until the broker has acknowledged every item (it answers 503 while it is down)."""
    waiting = {i["id"]: i for i in items}
    deadline = time.time() + timeout
    while waiting and time.time() < deadline:
        try:
            results = client.post("/v1/ingestion", json={"batch": list(waiting.values())}).json()["results"]
        except httpx.HTTPError:
            results = []
        for result in results:
            if result["status"] == 201:
                waiting.pop(result["id"])
            else:
                assert result["status"] == 503, result
        if waiting:
            time.sleep(0.5)
    assert not waiting, f"not acknowledged within {timeout} s: {list(waiting)}"


def trajectory(completion_id: str, served_at: float) -> dict:
    served = datetime.fromtimestamp(served_at, UTC).isoformat()
    return dict(item(f"t-{completion_id}", {
        "completion_id": completion_id, "policy_version": "v0", "prompt_token_ids": [5, 6, 7],
        "completion_token_ids": [8, 9, 10], "completion_logprobs": [-2.0, -2.1, -1.9]}, type="trajectory"),
        timestamp=served)


def feedback(completion_id: str, kind: str) -> dict:
    return item(f"f-{uuid.uuid4().hex}", {"kind": kind, "completion_id": completion_id})
