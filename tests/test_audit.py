"""The audit log: append-only, shared by processes, read by `liverl audit`."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

from liverl.audit import AuditLog


def record_many(path, actor: str) -> None:
    log = AuditLog(path)
    for i in range(20):
        log.record(actor, "learner.pause", "learner", f"reason {i}", n=i)


def test_processes_append_concurrently_and_nothing_is_lost(tmp_path):
    path = tmp_path / "audit.db"
    with ProcessPoolExecutor(2) as pool:
        list(pool.map(record_many, [path, path], ["key-a", "key-b"]))
    entries = AuditLog(path).entries(limit=100)
    assert len(entries) == 40
    for actor in ("key-a", "key-b"):  # each writer's entries in the order it wrote them
        assert [e.details["n"] for e in entries if e.actor == actor] == list(range(20))


def test_cli_shows_the_newest_entries_of_an_action(tmp_path):
    log = AuditLog(tmp_path / "audit.db")
    log.record("key-a", "keys.create", "acme", "onboarding", scopes=["feedback"])
    log.record("key-a", "sql", "", "", query="SELECT 1")
    out = subprocess.run([sys.executable, "-m", "app.cli", "audit", "--json", "--action", "keys.create",
                          "--data-dir", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["actor"], r["action"], r["target"], r["reason"], r["details"]) for r in rows] == [
        ("key-a", "keys.create", "acme", "onboarding", {"scopes": ["feedback"]})]
