"""One append-only audit log of every admin action, whichever component took it.

SQLite in the data directory: several processes (the ingest API's key endpoints, the
learner's control, the sink's SQL, the CLI) append to it at once, and readers never see
half a row. Rows are never updated or deleted.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

SCHEMA = """CREATE TABLE IF NOT EXISTS audit (
    at REAL NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL, target TEXT NOT NULL,
    reason TEXT NOT NULL, details TEXT NOT NULL
)"""


class Reason(BaseModel):
    """The body of every admin change: why, never blank."""

    reason: str = Field(min_length=1, description="Why: kept in the version's history and the audit log.")

    @field_validator("reason")
    @classmethod
    def not_blank(cls, reason: str) -> str:
        if not reason.strip():
            raise ValueError("a reason is required")
        return reason.strip()


class AuditEntry(BaseModel):
    at: float = Field(description="Unix time of the action.")
    actor: str = Field(description="Key id (or process name) that took the action.")
    action: str = Field(description="What was done, e.g. 'keys.create', 'learner.pause', 'sql'.")
    target: str = Field("", description="What it was done to: a tenant, a version, a component.")
    reason: str = Field("", description="Why, as the actor said it.")
    details: dict = Field(default_factory=dict, description="Figures or parameters of the action.")


class AuditLog:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as db, db:
            db.execute(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30)

    def record(self, actor: str, action: str, target: str = "", reason: str = "", **details) -> None:
        with closing(self._connect()) as db, db:
            db.execute("INSERT INTO audit VALUES (?,?,?,?,?,?)",
                       (time.time(), actor, action, target, reason, json.dumps(details, default=str)))

    def entries(self, limit: int = 100, action: str | None = None) -> list[AuditEntry]:
        """The newest `limit` entries (optionally of one action), oldest first."""
        query, args = "SELECT * FROM audit", []
        if action:
            query, args = query + " WHERE action = ?", [action]
        with closing(self._connect()) as db:
            rows = db.execute(query + " ORDER BY rowid DESC LIMIT ?", [*args, limit]).fetchall()
        return [AuditEntry(at=r[0], actor=r[1], action=r[2], target=r[3], reason=r[4],
                           details=json.loads(r[5])) for r in reversed(rows)]
