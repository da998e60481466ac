"""The gateway's outbox: records the broker did not take, kept on disk within a bound in
bytes and handed back, oldest first, for re-publishing.

SQLite in WAL mode rather than segment files of our own: a record is one transaction, so
a kill mid-write leaves a WAL frame whose checksum fails and SQLite discards it when the
file is next opened (a torn record is never read back, half or whole); a delivered record
is deleted by its id, whatever order the broker's reports come in; and its rowid keeps
the order records were put in. synchronous=NORMAL: a commit is in the operating system's
page cache, so it survives a kill of the gateway (fsync on a checkpoint only, so a power
cut may lose the last records; an fsync per record would stall serving while the broker
is away). On disk it takes the bound plus the WAL between checkpoints (WAL_LIMIT_BYTES):
deleted pages are reused, and a WAL a large record grew is cut back after a checkpoint.

One gateway process owns one outbox file (`slot-N.db`, held by an flock on its `.lock`):
a gateway takes the lowest free slot, so a gateway restarted on its data directory finds
what it left, and a second gateway on the same directory (as tests run) keeps its own.
"""

from __future__ import annotations

import fcntl
import sqlite3
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import IO

from prometheus_client import Counter, Gauge

from liverl.observability import log, setup_logging

HELD_BYTES = Gauge("liverl_gateway_outbox_bytes", "Bytes of records the outbox holds for re-publishing")
HELD_RECORDS = Gauge("liverl_gateway_outbox_records", "Records the outbox holds for re-publishing")
DROPPED = Counter("liverl_gateway_outbox_dropped_total", "Records the broker did not take and the outbox "
                  "could not keep (past its bound, the disk refused them, or too large for the broker): lost")
logger = setup_logging("gateway")
SCHEMA = """CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY, topic TEXT NOT NULL, key BLOB, value BLOB NOT NULL)"""
WAL_LIMIT_BYTES = 4 * 1024 * 1024  # SQLite checkpoints every 1000 pages (4 MiB); a larger WAL is cut back to it


@dataclass(frozen=True)
class Kept:
    """One record as the outbox keeps it: `id` orders it and deletes it once delivered."""

    id: int
    topic: str
    key: bytes | None
    value: bytes

    @property
    def size(self) -> int:
        return record_size(self.topic, self.key, self.value)


def record_size(topic: str, key: bytes | None, value: bytes) -> int:
    """What a record counts against the bound: its bytes (SQLite's page overhead is a few %)."""
    return len(topic.encode()) + len(key or b"") + len(value)


def take_slot(folder: Path) -> tuple[Path, IO[bytes]]:
    """The lowest slot no live process holds, with its lock (held until the file is closed)."""
    folder.mkdir(parents=True, exist_ok=True)
    for n in count():
        lock = open(folder / f"slot-{n}.lock", "wb")  # noqa: SIM115 (held for the outbox's life)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return folder / f"slot-{n}.db", lock
    raise AssertionError("unreachable")


class Outbox:
    """Records kept in order within `bound` bytes; one past it is counted dropped and logged."""

    def __init__(self, folder: Path, bound: int):
        self.bound = bound
        self.path, self.lock = take_slot(folder)
        self.db = sqlite3.connect(self.path, isolation_level=None)  # autocommit: one statement, one transaction
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", f"journal_size_limit={WAL_LIMIT_BYTES}"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.execute(SCHEMA)
        self.records, self.bytes = self.db.execute(
            "SELECT count(*), coalesce(sum(length(CAST(topic AS BLOB)) + coalesce(length(key), 0) "
            "+ length(value)), 0) FROM outbox").fetchone()
        self.show()

    def show(self) -> None:
        HELD_RECORDS.set(self.records)
        HELD_BYTES.set(self.bytes)

    def put(self, topic: str, key: bytes | None, value: bytes) -> bool:
        """Keep a record, unless it would take the outbox past its bound or the disk refuses it."""
        size = record_size(topic, key, value)
        if self.bytes + size > self.bound:
            return self.dropped(topic, f"the outbox holds {self.bytes} of its {self.bound} bytes")
        try:
            self.db.execute("INSERT INTO outbox (topic, key, value) VALUES (?, ?, ?)", (topic, key, value))
        except sqlite3.Error as error:  # a full disk among them
            return self.dropped(topic, f"{self.path}: {error}")
        self.records, self.bytes = self.records + 1, self.bytes + size
        self.show()
        return True

    def dropped(self, topic: str, why: str) -> bool:
        DROPPED.inc()
        log(logger, "outbox: record dropped", topic=topic, error=why)
        return False

    def oldest(self, limit_bytes: int) -> list[Kept]:
        """The oldest records, as many as fit in `limit_bytes` (at least one)."""
        kept: list[Kept] = []
        total = 0
        rows = self.db.execute("SELECT id, topic, key, value FROM outbox ORDER BY id")
        try:
            for row in rows:
                record = Kept(*row)
                if kept and total + record.size > limit_bytes:
                    break
                kept.append(record)
                total += record.size
        finally:
            rows.close()  # an unfinished read would hold back SQLite's checkpoints
        return kept

    def remove(self, record: Kept) -> None:
        """A record the broker took."""
        if self.db.execute("DELETE FROM outbox WHERE id = ?", (record.id,)).rowcount:
            self.records, self.bytes = self.records - 1, self.bytes - record.size
            self.show()

    def discard(self, record: Kept, why: str) -> None:
        """A record the broker will never take (too large for it): dropped, not retried forever."""
        self.remove(record)
        self.dropped(record.topic, why)

    def close(self) -> None:
        self.db.close()  # the last connection checkpoints the WAL into the file
        self.lock.close()
