"""The feedback stream's state outlives its worker: killed (SIGKILL) with reward windows open,
together with the broker, and started again by the supervisor, the worker recovers its table
from the changelog on disk and every window's outcome comes out exactly once: the revisions go
on from where they were, a silent completion gets its tenant's default reward at its original
deadline (not the restart's time plus a window), feedback that found no trajectory is
dead-lettered. A clean `liverl down` and `liverl up`: benchmarks/check_stream_down_up.py.

Read from the topics the learner and the sink read, not from ClickHouse, whose tables keep one
row per event id and could not show an outcome sent twice."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from datetime import datetime

import httpx
from helpers import feedback, ingest, outcomes, sql, trajectory, wait_for

from app.stack import component_healthy
from feedback.join import UNJOINABLE
from liverl.keys import KeyStore
from liverl.manifest import read_manifest
from liverl.process import alive

TENANT = "restart"  # the one tenant whose windows close with a default reward (tests/conftest.py)
DEFAULT_REWARD = 0.25
TICK_WORK_S = 3.0  # how late past a sweep a window may close on a loaded machine


def component(settings, name: str):
    return next(c for c in read_manifest(settings).components if c.name == name)


def recovered_since(settings, since: float) -> float | None:
    """When the worker last recovered its table (and reindexed its windows), if after `since`."""
    try:
        at = httpx.get(settings.url(settings.ports.feedback) + "/table", timeout=5).json()["recovered_at"]
    except httpx.HTTPError:
        return None
    return at if at is not None and at >= since else None


def killed(settings, victims: tuple[str, ...]) -> dict:
    """SIGKILL each victim at once; their manifest entries from before."""
    before = {name: component(settings, name) for name in victims}
    for c in before.values():
        os.kill(c.pid, signal.SIGKILL)
    return before


def restarted(settings, before: dict) -> None:
    """Until the supervisor has each one started again and healthy."""
    def back(old) -> bool:
        now = component(settings, old.name)
        return now.pid != old.pid and alive(now.pid) and now.restarts == old.restarts + 1 and component_healthy(now)
    wait_for(lambda: all(back(c) for c in before.values()), timeout=90)


def test_open_windows_outlive_a_killed_stream_and_broker(settings, stack):
    victims = ("feedback", "broker")  # the worker recovers its table from a broker restarted from disk
    key, _ = KeyStore(settings.keys_file).create(TENANT, scopes=["feedback", "trajectories"])
    run = uuid.uuid4().hex[:8]
    # heard: feedback before the kill and after the restart (revisions 0 and 1); silent: no
    # feedback (the default reward at its deadline); orphan: feedback for a completion never
    # served (a dead letter when its window closes).
    heard, silent, orphan = (f"cmpl-{name}-{run}" for name in ("heard", "silent", "orphan"))
    window, sweep = settings.feedback.reward_window_s, settings.feedback.sweep_interval_s
    with httpx.Client(base_url=settings.url(settings.ports.api), timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as client:
        served_at = time.time()
        ingest(client, [trajectory(heard, served_at), trajectory(silent, served_at),
                        feedback(heard, "accept"), feedback(orphan, "accept")])
        # Revision 0 in the warehouse: the stream has joined them and changelogged their windows.
        wait_for(lambda: sql(settings, f"SELECT count() AS n FROM samples WHERE sample_id = '{TENANT}:{heard}'")
                 [0]["n"], timeout=window / 2)
        killed_at = time.time()
        restarted(settings, killed(settings, victims))
        recovered = wait_for(lambda: recovered_since(settings, killed_at), timeout=window)
        print(f"stream back {recovered - killed_at:.1f} s after the kill")
        assert recovered < served_at + window - 2 * sweep, "the windows closed while the stream was down"
        ingest(client, [feedback(heard, "reject")])
    deadline = served_at + window

    def complete():
        samples, letters = outcomes(settings, run)
        return (samples, letters) if len(samples) >= 3 and letters else None
    wait_for(complete, timeout=window, interval=1)
    time.sleep(2 * sweep)  # anything sent twice would be out by now
    samples, letters = outcomes(settings, run)
    assert sorted((s["sample_id"], s["revision"], s["reward_source"]) for s in samples) == [
        (f"{TENANT}:{heard}", 0, "feedback"), (f"{TENANT}:{heard}", 1, "feedback"),
        (f"{TENANT}:{silent}", 0, "default")]
    assert [(d["reason"], json.loads(d["payload"])["body"]["completion_id"]) for d in letters] == [(UNJOINABLE, orphan)]
    default = next(s for s in samples if s["reward_source"] == "default")
    # At its original deadline, which the restart did not move: a deadline restarted with the
    # worker would fall a window after it came back. Late by at most a sweep's phase and a
    # tick's work (the stream's time measured against a broker just restarted, on two cores
    # the whole stack shares: 2.2 s seen with a 1 s sweep).
    emitted = datetime.fromisoformat(default["timestamp"]).timestamp()
    assert default["reward"] == DEFAULT_REWARD
    assert deadline <= emitted <= min(deadline + sweep + TICK_WORK_S, recovered + window), \
        f"default {emitted - served_at:.1f} s after serving; window {window} s, back {recovered - served_at:.1f} s"
