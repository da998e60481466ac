"""Version records: what the delta store holds for each version (see `sync.transport`)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from liverl.settings import Settings
from sync.store import DeltaStore, open_store

RECORDS = "versions/"
OBJECT_PREFIXES = ("deltas/", "snapshots/")


class StoredObject(BaseModel):
    key: str
    size: int = Field(description="Bytes in the store.")


class VersionRecord(BaseModel):
    version: str
    seq: int
    parent: str | None
    digest: str = Field(description="state_digest of the version's tensors.")
    nbytes: int = Field(description="Bytes of the version's tensors.")
    delta: StoredObject | None = Field(None, description="The change from the parent.")
    snapshot: StoredObject | None = Field(None, description="The whole version.")


def record_key(version: str) -> str:
    return f"{RECORDS}{version}.json"


def delta_key(version: str) -> str:
    return f"deltas/{version}.delta"


def snapshot_key(version: str) -> str:
    return f"snapshots/{version}.delta"


def read_records(store: DeltaStore) -> dict[str, VersionRecord]:
    return {r.version: r for r in (VersionRecord.model_validate_json(store.get_bytes(key))
                                   for key in store.list(RECORDS))}


def write_record(store: DeltaStore, record: VersionRecord) -> None:
    store.put_bytes(record_key(record.version), record.model_dump_json().encode())


def sync_store(settings: Settings) -> DeltaStore:
    return open_store(settings.delta_store, settings.data_dir, retries=settings.sync.fetch_retries)
