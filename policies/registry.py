"""The policy registry: immutable versions, their lineage, and every state change.

Durable and embedded (SQLite in the data directory). A version's weights live in
`policies/<version>/` (Hugging Face format, bf16, read-only once written); its row
records the parent, the sample window it learned from (offsets with the broker's
cluster id, time range, counts), training metrics and a content hash. The learner
writes a version, the ids of the samples it trained on and the consumed offsets in
one transaction, which is what makes learning exactly-once across crashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from liverl.faults import crash_point
from liverl.pool import ROLLOUT

State = Literal["candidate", "canary", "stable", "rolled_back", "rejected", "superseded", "aborted"]
# A version in one of these states was taken off users for its quality: whatever the
# learner trained on top of it continues a rejected chain.
REJECTED = ("aborted", "rolled_back")
# The only moves a version's state may make. A candidate reaches users through canary;
# stable is left by being replaced (superseded) or rolled back, and an earlier stable or
# superseded version can return by a rollback. Aborted and rejected are final: the
# learner's newer candidates carry on instead.
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "candidate": ("canary", "superseded", "rejected"),
    "canary": ("stable", "aborted", "rolled_back", "superseded", "rejected"),
    "stable": ("superseded", "rolled_back"),
    "superseded": ("canary", "stable"),
    "rolled_back": ("stable",),
    "aborted": (),
    "rejected": (),
}


# The held-out watch's event on a stable version that surely lost held-out skill
# (`promotion/controller.py: watch_heldout`), read by `liverl status` and the demo.
HELDOUT_REGRESSION = "heldout_regression"


class IllegalTransition(ValueError):
    """A state change the lifecycle does not allow, or one without a reason."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (
    version TEXT PRIMARY KEY, seq INTEGER UNIQUE, parent TEXT, created_at REAL,
    state TEXT, model_dir TEXT, content_hash TEXT, window TEXT, metrics TEXT
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, version TEXT, at REAL, from_state TEXT,
    to_state TEXT, actor TEXT, reason TEXT
);
CREATE TABLE IF NOT EXISTS rewinds (
    id INTEGER PRIMARY KEY AUTOINCREMENT, version TEXT, at REAL, after_seq INTEGER,
    actor TEXT, reason TEXT
);
CREATE TABLE IF NOT EXISTS pins (
    id INTEGER PRIMARY KEY AUTOINCREMENT, alias TEXT, version TEXT, at REAL, actor TEXT,
    reason TEXT, pinned INTEGER
);
CREATE TABLE IF NOT EXISTS aliases (
    id INTEGER PRIMARY KEY AUTOINCREMENT, alias TEXT, version TEXT, at REAL, actor TEXT, reason TEXT
);
CREATE TABLE IF NOT EXISTS trained_samples (sample_id TEXT PRIMARY KEY, version TEXT);
-- Every sample each version was written from, repeats kept: where exactly-once is checked.
CREATE TABLE IF NOT EXISTS version_samples (version TEXT, sample_id TEXT);
CREATE INDEX IF NOT EXISTS version_samples_by_sample ON version_samples (sample_id);
-- Samples the learner consumed and will never train (stale, consent, poison...), written with
-- the offsets that consumed them: a sample not learned is either here or not yet consumed.
CREATE TABLE IF NOT EXISTS dropped_samples (sample_id TEXT, reason TEXT);
CREATE INDEX IF NOT EXISTS dropped_samples_by_sample ON dropped_samples (sample_id);
CREATE TABLE IF NOT EXISTS offsets (
    cluster_id TEXT, topic TEXT, partition INTEGER, next_offset INTEGER,
    PRIMARY KEY (cluster_id, topic, partition)
);
"""


def check_transition(version: str, from_state: str, to_state: str, reason: str) -> None:
    """Refuse a move the lifecycle does not allow, or one nobody explained."""
    if not reason or not reason.strip():
        raise IllegalTransition(f"{version}: a reason is required to move it from {from_state} to {to_state}")
    allowed = TRANSITIONS[from_state]
    if to_state not in allowed:
        raise IllegalTransition(
            f"{version} is {from_state}; it cannot become {to_state} "
            f"({'it is final' if not allowed else 'from ' + from_state + ' it can become ' + ', '.join(allowed)})")


class SampleWindow(BaseModel):
    cluster_id: str = Field(description="Broker cluster the offsets belong to.")
    offsets: dict[str, int] = Field(description="'topic:partition' -> next offset to read.")
    first_served: float | None = None
    last_served: float | None = None
    samples: int = 0
    dropped_stale: int = 0
    dropped_consent: int = 0
    per_version: dict[str, int] = Field(default_factory=dict, description="Samples by behaviour version.")


class Rewind(BaseModel):
    """The learner is to continue from `version`, dropping what it trained after it."""

    id: int
    version: str
    at: float
    after_seq: int = Field(description="The newest version's seq when the rewind was asked.")
    actor: str
    reason: str


# The lifecycle's own names, and the pool's name for replicas lent to rollouts: no team
# alias may take them.
LIFECYCLE_ALIASES = ("stable", "canary", ROLLOUT)


class AliasMove(BaseModel):
    """A team's alias pointed at a version (or removed: version None)."""

    alias: str
    version: str | None
    at: float
    actor: str
    reason: str


class Pin(BaseModel):
    """On-call holds what an alias serves: no automatic promotion moves it while pinned
    (the guard still aborts a clearly worse canary)."""

    alias: str
    version: str | None = Field(description="What the alias served when pinned.")
    at: float
    actor: str
    reason: str
    pinned: bool


class PolicyVersion(BaseModel):
    version: str
    seq: int
    parent: str | None
    created_at: float
    state: State
    model_dir: str
    content_hash: str
    window: SampleWindow | None
    metrics: dict


def content_hash(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(model_dir.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(model_dir).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _make_read_only(model_dir: Path) -> None:
    for path in model_dir.rglob("*"):
        if path.is_file():
            path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


class Registry:
    def __init__(self, policies_dir: Path):
        self.root = policies_dir
        self.root.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.root / "registry.sqlite3", isolation_level=None,
                                  check_same_thread=False, timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- reading -------------------------------------------------------------------------
    def _row(self, row: tuple) -> PolicyVersion:
        version, seq, parent, created, state, model_dir, chash, window, metrics = row
        return PolicyVersion(version=version, seq=seq, parent=parent, created_at=created,
                             state=state, model_dir=model_dir, content_hash=chash,
                             window=SampleWindow.model_validate_json(window) if window else None,
                             metrics=json.loads(metrics or "{}"))

    def versions(self) -> list[PolicyVersion]:
        return [self._row(r) for r in self.db.execute("SELECT * FROM versions ORDER BY seq")]

    def get(self, version: str) -> PolicyVersion:
        row = self.db.execute("SELECT * FROM versions WHERE version = ?", (version,)).fetchone()
        if row is None:
            raise KeyError(f"no policy version {version!r}")
        return self._row(row)

    def latest(self) -> PolicyVersion | None:
        row = self.db.execute("SELECT * FROM versions ORDER BY seq DESC LIMIT 1").fetchone()
        return self._row(row) if row else None

    def stable(self) -> PolicyVersion | None:
        row = self.db.execute(
            "SELECT * FROM versions WHERE state = 'stable' ORDER BY seq DESC LIMIT 1").fetchone()
        return self._row(row) if row else None

    def in_state(self, state: State) -> list[PolicyVersion]:
        return [self._row(r) for r in self.db.execute(
            "SELECT * FROM versions WHERE state = ? ORDER BY seq", (state,))]

    def ancestors(self, version: str, until: str | None, most: int | None = None) -> list[PolicyVersion]:
        """The versions `version` was trained on top of, nearest first, back to `until`
        (not included; None: back to the first), at most `most` of them."""
        out: list[PolicyVersion] = []
        current = self.get(version).parent
        while current is not None and current != until and (most is None or len(out) < most):
            out.append(self.get(current))
            current = out[-1].parent
        return out

    def steps_apart(self, version: str, other: str, limit: int) -> int | None:
        """How many training steps (parent links) separate two versions, through their
        nearest common ancestor; None when more than `limit`, unrelated, or unknown.

        This, not the difference of their numbers, is how far a sample's behaviour policy
        is from the weights that train on it: versions registered meanwhile on other
        branches (a rejected canary, an import, a pin) changed neither."""
        if self.seq_of(version) is None or self.seq_of(other) is None:
            return None

        def lineage(start: str) -> dict[str, int]:  # version -> steps up from start, at most limit
            up = [start, *(a.version for a in self.ancestors(start, None, limit))]
            return {v: steps for steps, v in enumerate(up)}
        up_other = lineage(other)
        apart = [steps + up_other[v] for v, steps in lineage(version).items() if v in up_other]
        return min(apart) if apart and min(apart) <= limit else None

    def continues_rejected(self, version: str) -> str | None:
        """The aborted or rolled-back version that `version` was trained on top of (itself
        included), or None: its lineage back to the stable version is clean."""
        stable = self.stable()
        if stable is not None and version == stable.version:
            return None
        lineage = [self.get(version), *self.ancestors(version, stable.version if stable else None)]
        return next((record.version for record in lineage if record.state in REJECTED), None)

    def last_rewind(self) -> Rewind | None:
        row = self.db.execute("SELECT * FROM rewinds ORDER BY id DESC LIMIT 1").fetchone()
        return Rewind(**dict(zip(Rewind.model_fields, row, strict=True))) if row else None

    def rewinds_since(self, version: str) -> int:
        """How many times, since `version` last became stable, the guard or an operator put the
        learner back (on it, or after a hold for skill on a version trained on top of it:
        `promotion.skill_rewind`); the learner's own rebases and gate rewinds aside (`actor`
        "learner")."""
        since = self.db.execute("SELECT max(at) FROM events WHERE version = ? AND to_state = 'stable'",
                                (version,)).fetchone()[0]
        return self.db.execute("SELECT count(*) FROM rewinds WHERE at >= ? AND actor != 'learner'",
                               (since or 0.0,)).fetchone()[0]

    def head(self) -> PolicyVersion | None:
        """The version the learner continues from: the newest, unless it was trained
        before the last rewind (its metrics name the rewinds its learner had applied)."""
        latest, rewind = self.latest(), self.last_rewind()
        if rewind is not None and latest is not None and latest.metrics.get("after_rewind", 0) < rewind.id:
            return self.get(rewind.version)
        return latest

    def rollout_version(self) -> PolicyVersion:
        """The version rollouts sample from: the learner's head, or stable before its first."""
        version = self.head() or self.stable()
        assert version is not None, "the registry holds the starter at least"
        return version

    def history(self, version: str | None = None) -> list[dict]:
        query = "SELECT version, at, from_state, to_state, actor, reason FROM events"
        rows = self.db.execute(query + (" WHERE version = ?" if version else "") + " ORDER BY id",
                               (version,) if version else ())
        return [dict(zip(("version", "at", "from", "to", "actor", "reason"), r, strict=True)) for r in rows]

    def offsets(self, cluster_id: str) -> dict[str, int]:
        rows = self.db.execute(
            "SELECT topic, partition, next_offset FROM offsets WHERE cluster_id = ?", (cluster_id,))
        return {f"{t}:{p}": o for t, p, o in rows}

    def trained(self, sample_ids: list[str]) -> set[str]:
        found: set[str] = set()
        for i in range(0, len(sample_ids), 500):
            chunk = sample_ids[i:i + 500]
            found.update(r[0] for r in self.db.execute(
                f"SELECT sample_id FROM trained_samples WHERE sample_id IN ({','.join('?' * len(chunk))})",
                chunk))
        return found

    def times_learned(self, sample_ids: list[str]) -> dict[str, int]:
        """How many versions were written from each of `sample_ids` (absent: none): more
        than one is a sample learned twice."""
        counts: dict[str, int] = {}
        for i in range(0, len(sample_ids), 500):
            chunk = sample_ids[i:i + 500]
            counts.update(self.db.execute(
                f"SELECT sample_id, count(*) FROM version_samples WHERE sample_id IN ({','.join('?' * len(chunk))}) "
                "GROUP BY sample_id", chunk).fetchall())
        return counts

    def dropped(self, sample_ids: list[str]) -> dict[str, str]:
        """Why each of `sample_ids` the learner dropped was dropped (absent: not dropped)."""
        reasons: dict[str, str] = {}
        for i in range(0, len(sample_ids), 500):
            chunk = sample_ids[i:i + 500]
            reasons.update(self.db.execute(
                f"SELECT sample_id, reason FROM dropped_samples WHERE sample_id IN ({','.join('?' * len(chunk))})",
                chunk).fetchall())
        return reasons

    def seq_of(self, version: str) -> int | None:
        row = self.db.execute("SELECT seq FROM versions WHERE version = ?", (version,)).fetchone()
        return row[0] if row else None

    # --- writing -------------------------------------------------------------------------
    def publish(self, staged_dir: Path, *, parent: str | None, window: SampleWindow | None,
                metrics: dict, sample_ids: list[str], actor: str,
                state: State = "candidate", dropped: list[tuple[str, str]] | None = None) -> PolicyVersion:
        """Move a fully written model directory in as the next version, atomically (with
        the (sample id, reason) of the samples dropped since the last offsets recorded)."""
        latest = self.latest()
        seq = latest.seq + 1 if latest else 0
        version = f"v{seq}"
        final = self.root / version
        if final.exists():  # a crash after the rename, before the commit: not a version
            shutil.rmtree(final)
        chash = content_hash(staged_dir)
        os.replace(staged_dir, final)
        _make_read_only(final)
        crash_point("registry.publish.after_rename")  # a directory, not yet a version
        with self.transaction() as db:
            db.execute("INSERT INTO versions VALUES (?,?,?,?,?,?,?,?,?)",
                       (version, seq, parent, time.time(), state, str(final), chash,
                        window.model_dump_json() if window else None, json.dumps(metrics)))
            db.executemany("INSERT OR IGNORE INTO trained_samples VALUES (?, ?)",
                           [(s, version) for s in sample_ids])
            db.executemany("INSERT INTO version_samples VALUES (?, ?)", [(version, s) for s in sample_ids])
            if window:
                self._write_offsets(db, window.cluster_id, window.offsets)
            db.executemany("INSERT INTO dropped_samples VALUES (?, ?)", dropped or [])
            db.execute("INSERT INTO events (version, at, from_state, to_state, actor, reason) "
                       "VALUES (?,?,?,?,?,?)", (version, time.time(), None, state, actor, "published"))
        return self.get(version)

    def record_offsets(self, cluster_id: str, offsets: dict[str, int],
                       dropped: list[tuple[str, str]] | None = None) -> None:
        """Advance offsets past samples that were consumed but not learned (dropped: their
        (sample id, reason), kept with the offsets)."""
        with self.transaction() as db:
            self._write_offsets(db, cluster_id, offsets)
            db.executemany("INSERT INTO dropped_samples VALUES (?, ?)", dropped or [])

    @staticmethod
    def _write_offsets(db: sqlite3.Connection, cluster_id: str, offsets: dict[str, int]) -> None:
        for key, offset in offsets.items():
            topic, _, partition = key.rpartition(":")
            db.execute("INSERT OR REPLACE INTO offsets VALUES (?,?,?,?)",
                       (cluster_id, topic, int(partition), offset))

    def check(self, version: str, to_state: State, reason: str) -> PolicyVersion:
        """The version, if it may move to `to_state` for `reason`; IllegalTransition if not
        (before anyone touches a replica for a move that would be refused)."""
        record = self.get(version)
        check_transition(version, record.state, to_state, reason)
        return record

    def pin(self, alias: str, actor: str, reason: str, pinned: bool = True) -> Pin:
        """Pin (or unpin) an alias; each call is kept, so the pins' history is the table."""
        if not reason or not reason.strip():
            raise IllegalTransition(f"a reason is required to {'pin' if pinned else 'unpin'} {alias}")
        if alias != "stable":
            raise KeyError(f"no alias {alias!r} (aliases: stable)")
        current = self.stable()
        with self.transaction() as db:
            db.execute("INSERT INTO pins (alias, version, at, actor, reason, pinned) VALUES (?,?,?,?,?,?)",
                       (alias, current.version if current else None, time.time(), actor, reason, int(pinned)))
        return self.pins()[-1]

    def pins(self) -> list[Pin]:
        """Every pin and unpin, oldest first."""
        rows = self.db.execute("SELECT alias, version, at, actor, reason, pinned FROM pins ORDER BY id")
        return [Pin(**dict(zip(("alias", "version", "at", "actor", "reason", "pinned"), r, strict=True))) for r in rows]

    def move_alias(self, alias: str, version: str | None, actor: str, reason: str) -> AliasMove:
        """Point a team's alias at a version (None removes it); each move is kept. `stable`
        and `canary` move only with the lifecycle (promote, abort, rollback)."""
        if not reason or not reason.strip():
            raise IllegalTransition(f"a reason is required to move alias {alias}")
        if alias in LIFECYCLE_ALIASES:
            raise IllegalTransition(f"{alias} moves with the lifecycle: promote, abort or roll back instead")
        if version is not None:
            self.get(version)  # KeyError when there is no such version
        elif alias not in self.aliases():
            raise KeyError(f"no alias {alias!r} (aliases: {', '.join(sorted(self.aliases())) or 'none'})")
        with self.transaction() as db:
            db.execute("INSERT INTO aliases (alias, version, at, actor, reason) VALUES (?,?,?,?,?)",
                       (alias, version, time.time(), actor, reason))
        return self.alias_moves()[-1]

    def alias_moves(self) -> list[AliasMove]:
        """Every move of a team's alias, oldest first."""
        rows = self.db.execute("SELECT alias, version, at, actor, reason FROM aliases ORDER BY id")
        return [AliasMove(**dict(zip(("alias", "version", "at", "actor", "reason"), r, strict=True))) for r in rows]

    def aliases(self) -> dict[str, str]:
        """The teams' aliases now: alias -> version."""
        now: dict[str, str | None] = {}
        for move in self.alias_moves():
            now[move.alias] = move.version
        return {alias: version for alias, version in now.items() if version is not None}

    def pinned(self, alias: str = "stable") -> Pin | None:
        """The alias's pin, if it is pinned now."""
        latest = [p for p in self.pins() if p.alias == alias][-1:]
        return latest[0] if latest and latest[0].pinned else None

    def transition(self, version: str, to_state: State, actor: str, reason: str) -> PolicyVersion:
        return self.transitions([(version, to_state, reason)], actor)[0]

    def transitions(self, moves: list[tuple[str, State, str]], actor: str) -> list[PolicyVersion]:
        """Several (version, state, reason) moves in one transaction: stable handed from one
        version to another is never seen missing (or doubled) by a reader in between."""
        with self.transaction() as db:
            for version, to_state, reason in moves:
                current = db.execute("SELECT state FROM versions WHERE version = ?", (version,)).fetchone()
                if current is None:
                    raise KeyError(f"no policy version {version!r}")
                check_transition(version, current[0], to_state, reason)
                db.execute("UPDATE versions SET state = ? WHERE version = ?", (to_state, version))
                db.execute("INSERT INTO events (version, at, from_state, to_state, actor, reason) "
                           "VALUES (?,?,?,?,?,?)", (version, time.time(), current[0], to_state, actor, reason))
        return [self.get(version) for version, _, _ in moves]

    def record_event(self, version: str, event: str, actor: str, reason: str) -> None:
        """Something that happened to a version without changing its state (a canary held
        for a human): in its history as `state -> event`."""
        with self.transaction() as db:
            db.execute("INSERT INTO events (version, at, from_state, to_state, actor, reason) "
                       "SELECT version, ?, state, ?, ?, ? FROM versions WHERE version = ?",
                       (time.time(), event, actor, reason, version))

    def request_rewind(self, version: str, actor: str, reason: str) -> Rewind:
        """Ask the learner to continue from `version` (a stable one it can rebuild)."""
        self.get(version)
        with self.transaction() as db:
            latest = db.execute("SELECT max(seq) FROM versions").fetchone()[0]
            db.execute("INSERT INTO rewinds (version, at, after_seq, actor, reason) VALUES (?,?,?,?,?)",
                       (version, time.time(), latest, actor, reason))
        rewind = self.last_rewind()
        assert rewind is not None, "the rewind just inserted"
        return rewind

    def drop_weights(self, version: str, reason: str) -> None:
        """Delete a version's weights directory; its record, lineage and history stay."""
        record = self.get(version)
        model_dir = Path(record.model_dir)
        if not model_dir.exists():
            return
        for path in model_dir.rglob("*"):  # published read-only
            path.chmod(stat.S_IRWXU)
        shutil.rmtree(model_dir)
        with self.transaction() as db:  # the state does not change; the history says why the files went
            db.execute("INSERT INTO events (version, at, from_state, to_state, actor, reason) "
                       "VALUES (?,?,?,?,?,?)", (version, time.time(), record.state, record.state,
                                                "retention", reason))

    def update_metrics(self, version: str, **metrics: object) -> None:
        with self.transaction() as db:
            row = db.execute("SELECT metrics FROM versions WHERE version = ?", (version,)).fetchone()
            merged = dict(json.loads(row[0] or "{}"), **metrics)
            db.execute("UPDATE versions SET metrics = ? WHERE version = ?", (json.dumps(merged), version))
