"""API keys: per-tenant write keys and admin keys, stored hashed in one JSON file.

The file is re-read when it changes, so `liverl keys revoke` takes effect in running
servers within a request. Only a key's hash and a short prefix are ever stored or shown.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from fastapi import Depends, Header, HTTPException, Request
from pydantic import BaseModel, Field

from liverl.contracts import TenantId

Role = Literal["tenant", "admin"]
# What a tenant key may send: feedback on its completions, or trajectories that train the
# shared policy, which is granted explicitly (`liverl keys create TENANT --scope trajectories`).
Scope = Literal["feedback", "trajectories"]


class KeyRecord(BaseModel):
    key_id: str
    tenant: TenantId = Field(description="Stamped on every event the key writes.")
    role: Role
    scopes: list[Scope] = Field(["feedback"], description="What the key may send (keys from before scopes: feedback).")
    created_at: datetime
    revoked_at: datetime | None = None
    label: str = ""


def write_private(path: Path, text: str) -> None:
    """Replace `path` with `text`, readable by its owner only from its first byte: the file
    is created 0600 (never at the umask, then chmod-ed) and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self._by_hash: dict[str, KeyRecord] = {}

    def _load(self) -> dict[str, KeyRecord]:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return {}
        if mtime != self._mtime:
            raw = json.loads(self.path.read_text())
            self._by_hash = {h: KeyRecord.model_validate(r) for h, r in raw.items()}
            self._mtime = mtime
        return self._by_hash

    def _save(self, records: dict[str, KeyRecord]) -> None:
        write_private(self.path, json.dumps({h: r.model_dump(mode="json") for h, r in records.items()}))

    def get(self, key_id: str) -> KeyRecord | None:
        """The live (not revoked) key with this id."""
        with self._lock:
            record = next((r for r in self._load().values() if r.key_id == key_id), None)
        return record if record and record.revoked_at is None else None

    def authenticate(self, key: str) -> KeyRecord | None:
        with self._lock:
            record = self._load().get(hash_key(key))
        return record if record and record.revoked_at is None else None

    def create(self, tenant: str, role: Role = "tenant", label: str = "",
               scopes: list[Scope] | None = None) -> tuple[str, KeyRecord]:
        """Returns the plaintext key (shown once) and its record."""
        key = f"lrl_{'adm' if role == 'admin' else 'tnt'}_{secrets.token_urlsafe(24)}"
        record = KeyRecord(
            key_id=hash_key(key)[:12],
            tenant=tenant,
            role=role,
            scopes=scopes or ["feedback"],
            created_at=datetime.now(UTC),
            label=label,
        )
        with self._lock:
            records = dict(self._load())
            records[hash_key(key)] = record
            self._save(records)
        return key, record

    def list(self) -> list[KeyRecord]:
        with self._lock:
            return sorted(self._load().values(), key=lambda r: r.created_at)

    def revoke(self, key_id: str) -> KeyRecord:
        with self._lock:
            records = dict(self._load())
            for digest, record in records.items():
                if record.key_id == key_id:
                    records[digest] = record.model_copy(
                        update={"revoked_at": datetime.now(UTC)}
                    )
                    self._save(records)
                    return records[digest]
        raise KeyError(f"no key with id {key_id!r}")



def admin_key(settings) -> str:
    """The operator's admin key: `LIVERL_ADMIN_KEY`, else the one `liverl up` wrote to the
    dev keys file. The CLI, `down`'s flush and the demo call admin endpoints with it."""
    if key := os.environ.get("LIVERL_ADMIN_KEY"):
        return key
    try:
        return json.loads(settings.dev_keys_file.read_text())["admin_key"]
    except (FileNotFoundError, KeyError) as error:
        raise RuntimeError(f"no admin key: set LIVERL_ADMIN_KEY or start the stack once so "
                           f"{settings.dev_keys_file} exists ({error})") from None


def admin_headers(settings) -> dict[str, str]:
    return {"Authorization": f"Bearer {admin_key(settings)}"}


# --- FastAPI dependencies -----------------------------------------------------------
async def key_store(request: Request) -> KeyStore:
    return request.app.state.keys


async def require_key(
    authorization: str | None = Header(None), store: KeyStore = Depends(key_store)
) -> KeyRecord:
    """The caller's key record; 401 naming what is wrong otherwise."""
    if not authorization or not authorization.lower().startswith("bearer "):
        raise HTTPException(401, "missing API key: send 'Authorization: Bearer <key>'")
    record = store.authenticate(authorization[7:].strip())
    if record is None:
        raise HTTPException(401, "invalid or revoked API key")
    return record


async def require_admin(record: KeyRecord = Depends(require_key)) -> KeyRecord:
    if record.role != "admin":
        raise HTTPException(403, "this endpoint needs an admin key")
    return record
