"""Two feedback stream workers in one consumer group (`feedback.workers`): they share the
topics' partitions, a worker that joins takes its partitions' open windows from the one that
held them (which lets them go), and a worker killed with SIGKILL hands its partitions and their
table state to the other. Every completion's outcome comes out exactly once, read from the
samples topic (ClickHouse keeps one row per event id and could not show one sent twice)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections import Counter

import httpx
from helpers import feedback, ingest, outcomes, trajectory, wait_for

from app.stack import Launcher
from liverl.contracts import Topics
from liverl.kafka import group_lag, group_positions
from liverl.keys import KeyStore
from liverl.manifest import read_manifest
from liverl.process import stop_pid

TENANT = "restart"  # the one tenant whose windows close with a default reward (tests/conftest.py)
INCOMING = (Topics.TRAJECTORIES, Topics.FEEDBACK)
EACH = 12  # completions of each kind: both partitions get some


def table(settings, index: int) -> dict | None:
    """Worker `index`'s /table page: the partitions it reads and how far."""
    try:
        return httpx.get(settings.url(settings.ports.feedback + index) + "/table", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None


def owners(settings, workers: int) -> list[set[str]] | None:
    """The incoming partitions each worker reads, once every one has recovered its table."""
    pages = [table(settings, i) for i in range(workers)]
    if any(page is None or page["recovered_at"] is None for page in pages):
        return None
    return [set(page["partitions"]) for page in pages]  # type: ignore[index]


def worker_zero(settings):
    return next(c for c in read_manifest(settings).components if c.name == "feedback")


def positions(settings) -> dict:
    return asyncio.run(group_positions(settings, "liverl-feedback", INCOMING))


def caught_up(settings) -> bool:
    return asyncio.run(group_lag(settings, "liverl-feedback", INCOMING)) == 0


def test_two_workers_share_the_partitions_and_hand_them_over(settings, stack):
    key, _ = KeyStore(settings.keys_file).create(TENANT, scopes=["feedback", "trajectories"])
    run = uuid.uuid4().hex[:8]
    silent, pairs, handed = ([f"cmpl-{kind}{i}-{run}" for i in range(EACH)] for kind in ("silent", "pair", "handed"))
    window = settings.feedback.reward_window_s
    launcher = Launcher(settings, say=lambda _: None)
    first = worker_zero(settings)
    with httpx.Client(base_url=settings.url(settings.ports.api), timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as client:
        # Silent completions whose windows worker 0 holds open (served a little ahead, so the
        # second worker has joined before they fall due): whoever owns them when they do
        # gives each its default reward, once.
        served_at = time.time() + window / 2
        ingest(client, [trajectory(c, served_at) for c in silent])
        wait_for(lambda: caught_up(settings), timeout=60)
        every = set(table(settings, 0)["partitions"])
        assert len(every) >= 4, f"the stack's topics need several partitions: {every}"

        launcher.stream_worker(1)
        second = launcher.started[-1]
        try:
            shared = wait_for(lambda: (o := owners(settings, 2)) and all(o) and o, timeout=90)
            assert time.time() < served_at + window, "the windows fell due before the second worker joined"
            assert shared[0].isdisjoint(shared[1]) and shared[0] | shared[1] == every, shared

            ingest(client, [x for c in pairs for x in (trajectory(c, time.time()), feedback(c, "accept"))])
            try:
                wait_for(lambda: len([s for s in outcomes(settings, run)[0] if "pair" in s["sample_id"]]) >= EACH,
                         timeout=60, interval=1)
            except AssertionError:
                raise AssertionError(f"pairs not all joined in 60 s: workers {table(settings, 0)}, "
                                     f"{table(settings, 1)}; positions {positions(settings)}") from None
            for index in (0, 1):  # both did join work
                assert any(p["next"] is not None for p in table(settings, index)["partitions"].values()), index

            # Windows the second worker holds open, then it is killed: the first takes its
            # partitions with their states from the changelog, and their feedback joins there.
            ingest(client, [trajectory(c, time.time()) for c in handed])
            wait_for(lambda: caught_up(settings), timeout=60)
            os.kill(second.pid, signal.SIGKILL)
            ingest(client, [feedback(c, "reject") for c in handed])
            wait_for(lambda: (o := owners(settings, 1)) and o[0] == every, timeout=90)
        finally:  # the stack as the other tests know it: one worker, reading every partition
            stop_pid(second.pid, timeout=10)
            wait_for(lambda: (o := owners(settings, 1)) and o[0] == every, timeout=90)

    deadline = time.time() + 2 * window
    while len(outcomes(settings, run)[0]) < 3 * EACH and time.time() < deadline:  # else: what is missing, below
        time.sleep(1)
    time.sleep(3 * settings.feedback.sweep_interval_s)  # anything sent twice would be out by now
    samples, letters = outcomes(settings, run)
    # Handed over by the group, not by a restart of the first worker (which would hide a
    # worker that keeps closing windows of partitions it no longer owns).
    assert (worker_zero(settings).pid, worker_zero(settings).restarts) == (first.pid, first.restarts)
    assert letters == []
    try:  # and committed: nothing held back for good
        wait_for(lambda: caught_up(settings), timeout=30)
    except AssertionError:
        raise AssertionError(f"not committed: {table(settings, 0)}; positions {positions(settings)}") from None
    got = Counter((s["sample_id"], s["revision"], s["reward_source"]) for s in samples)
    expected = Counter([(f"{TENANT}:{c}", 0, "default") for c in silent]
                       + [(f"{TENANT}:{c}", 0, "feedback") for c in pairs + handed])
    assert got == expected, {"missing": sorted(expected - got), "more than expected": sorted(got - expected),
                             "worker": table(settings, 0), "positions": positions(settings)}
