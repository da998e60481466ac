"""The embedded broker keeps what it acknowledged: killed (SIGKILL) under load at a moment
when acknowledged events are not yet in ClickHouse (the sink paused for it), it is started
again by the supervisor, and every acknowledged event is stored exactly once. The same for
the store that keeps its topics on disk (app.broker_store)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import uuid

import httpx
import pytest
from helpers import item, sql, wait_for

from liverl.contracts import Topics
from liverl.kafka import group_lag
from liverl.manifest import read_manifest
from liverl.process import alive


def component(settings, name: str):
    return next(c for c in read_manifest(settings).components if c.name == name)


@pytest.mark.parametrize("victim", ["broker", "broker-store"])
def test_a_broker_killed_under_load_loses_no_acknowledged_event(settings, api, victim):
    prefix = f"kill-{victim}-{uuid.uuid4().hex[:8]}-"
    acknowledged: list[str] = []
    answers: dict[int, int] = {}
    stop = threading.Event()

    def load() -> None:  # one client, one batch of 50 at a time: bounded
        while not stop.is_set():
            batch = [item(f"{prefix}{uuid.uuid4().hex}", {"kind": "accept", "completion_id": f"c-{uuid.uuid4().hex}"})
                     for _ in range(50)]
            try:
                results = api.post("/v1/ingestion", json={"batch": batch}).json()["results"]
            except httpx.HTTPError:
                continue
            for result in results:
                answers[result["status"]] = answers.get(result["status"], 0) + 1
                if result["status"] == 201:
                    acknowledged.append(result["id"])

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(acknowledged) >= 1000, timeout=60)
        # The sink keeps up within milliseconds, so it is paused (SIGSTOP: a stuck sink) until
        # the kill: the events acknowledged meanwhile are in the broker, not in ClickHouse, when
        # it dies. (A count from ClickHouse would ask the paused sink.)
        sink = component(settings, "sink")
        os.kill(sink.pid, signal.SIGSTOP)
        try:
            acknowledged_at_pause = len(acknowledged)
            wait_for(lambda: len(acknowledged) >= acknowledged_at_pause + 200, timeout=60)
            before = component(settings, victim)
            os.kill(before.pid, signal.SIGKILL)
        finally:
            os.kill(sink.pid, signal.SIGCONT)
        wait_for(lambda: (now := component(settings, victim)).pid != before.pid and alive(now.pid)
                 and now.restarts == before.restarts + 1, timeout=30)
        acknowledged_at_restart = len(acknowledged)
        wait_for(lambda: len(acknowledged) >= acknowledged_at_restart + 500, timeout=60)  # accepted again
    finally:
        stop.set()
        thread.join(timeout=60)
    assert len(acknowledged) == len(set(acknowledged))

    def every_acknowledged_stored() -> dict[str, int] | None:
        counts = {r["event_id"]: r["n"] for r in sql(settings, "SELECT event_id, count() AS n FROM feedback_events "
                                                              f"WHERE event_id LIKE '{prefix}%' GROUP BY event_id")}
        return counts if counts.keys() >= set(acknowledged) else None
    counts = wait_for(every_acknowledged_stored, timeout=180, interval=1)
    # Each exactly once (an event the broker did not acknowledge in time, a 503, is the
    # client's to send again: stored once or not at all).
    assert {i: n for i, n in counts.items() if n > 1} == {}, answers
    # The stream, which lived through the kill, reads on past it as well.
    wait_for(lambda: asyncio.run(group_lag(settings, "liverl-feedback", (Topics.FEEDBACK, Topics.TRAJECTORIES))) == 0,
             timeout=120, interval=1)
