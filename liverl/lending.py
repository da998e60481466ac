"""Lending's records, which the capacity scheduler writes and on-call reads (`liverl
status`, `liverl capacity status`, the dashboard): every lend and take-back
(`run/capacity.jsonl`), and on-call's pause of lending (`run/capacity-pause.json`)."""

from __future__ import annotations

import os
import tempfile
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, Field, ValidationError

from liverl.audit import AuditLog
from liverl.contracts import CapacityEvent
from liverl.pool import read_pool
from liverl.process import wait_until
from liverl.settings import Settings


def events_file(settings: Settings) -> Path:
    return settings.run_dir / "capacity.jsonl"


def record_event(settings: Settings, event: CapacityEvent) -> None:
    with open(events_file(settings), "a") as out:
        out.write(event.model_dump_json() + "\n")


def read_events(settings: Settings, latest: int | None = None) -> list[CapacityEvent]:
    """The lends and take-backs, oldest first (the `latest` only, if given). A line that is
    not a whole event (the scheduler killed mid-write) is skipped: on-call's views keep working."""
    try:
        with open(events_file(settings)) as lines:
            tail = deque(lines, maxlen=latest)
    except FileNotFoundError:
        return []
    events = []
    for line in tail:
        try:
            events.append(CapacityEvent.model_validate_json(line))
        except ValidationError:
            continue
    return events


class LendingPause(BaseModel):
    """On-call's pause of lending (an incident, a launch coming): kept in `run/` so that a
    restarted scheduler keeps it."""

    actor: str = Field(description="Who paused: an admin key's id, or `cli:<user>`.")
    reason: str = Field(min_length=1, description="Why (also in the audit log).")
    at: datetime = Field(description="When.")


def pause_file(settings: Settings) -> Path:
    return settings.run_dir / "capacity-pause.json"


def read_pause(settings: Settings) -> LendingPause | None:
    try:
        return LendingPause.model_validate_json(pause_file(settings).read_text())
    except FileNotFoundError:  # not paused, or resumed just now
        return None


def set_pause(settings: Settings, pause: LendingPause | None) -> None:
    """Pause (or, with None, resume) lending; the scheduler reads it at every poll."""
    path = pause_file(settings)
    if pause is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # A file of its own for each writer (the controller's door and the scheduler's may write
    # at once), renamed over the pause: atomic, so the scheduler never reads half a file.
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(pause.model_dump_json())
    os.replace(tmp.name, path)


def hold_lending(settings: Settings, audit: AuditLog, actor: str, verb: Literal["pause", "resume"], reason: str,
                 wait_s: float, **details) -> dict:
    """On-call's pause (the scheduler takes every lent replica back at its next look and
    lends none until resumed) or resume, audited as `capacity.pause|resume`. A pause answers
    once no replica is lent, or after `wait_s` with those still lent (the scheduler down)."""
    set_pause(settings, LendingPause(actor=actor, reason=reason, at=datetime.now(UTC))
              if verb == "pause" else None)
    audit.record(actor, f"capacity.{verb}", "capacity", reason, **details)
    if verb == "pause":
        wait_until(lambda: not read_pool(settings).lent, wait_s, interval=settings.capacity.poll_s)
    return {"paused": verb == "pause", "lent": [r.name for r in read_pool(settings).lent]}


def lending_state(settings: Settings, latest: int = 5) -> dict:
    """What on-call asks of lending, as JSON: paused (who, when, why), the replicas lent and
    in production, and the `latest` lends and take-backs."""
    pool, pause = read_pool(settings), read_pause(settings)
    return {"paused": pause and pause.model_dump(mode="json"),
            "lent": [r.name for r in pool.lent], "production": [r.name for r in pool.general if r.enabled],
            "events": [e.model_dump(mode="json") for e in read_events(settings, latest)]}


def scheduler_answers(settings: Settings) -> bool:
    """Whether the capacity scheduler runs (and so lends when the load allows): what it
    does, not what the reader's own settings say."""
    try:
        return httpx.get(settings.url(settings.ports.capacity) + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
