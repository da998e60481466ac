"""Version records: what the delta store holds for each version (see `sync.transport`)."""

from __future__ import annotations

import logging

from pydantic import BaseModel, Field, ValidationError

from liverl.contracts import VersionName
from liverl.settings import Settings
from sync.store import DeltaStore, open_store

log = logging.getLogger(__name__)
RECORDS = "versions/"
OBJECT_PREFIXES = ("deltas/", "snapshots/")


class StoredObject(BaseModel):
    key: str
    size: int = Field(description="Bytes in the store.")


class VersionRecord(BaseModel):
    version: VersionName
    seq: int
    parent: VersionName | None
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
    """Every well-formed record; a malformed one (say, a version or parent name that is
    not a version name and would become a path) is skipped and logged, so it cannot stop
    the others from syncing nor reach the file system."""
    records = {}
    for key in store.list(RECORDS):
        try:
            record = VersionRecord.model_validate_json(store.get_bytes(key))
        except ValidationError as error:
            log.warning("ignoring the malformed version record %s: %s", key, error.errors()[0]["msg"])
            continue
        records[record.version] = record
    return records


def write_record(store: DeltaStore, record: VersionRecord) -> None:
    store.put_bytes(record_key(record.version), record.model_dump_json().encode())


def sync_store(settings: Settings) -> DeltaStore:
    return open_store(settings.delta_store, settings.data_dir, retries=settings.sync.fetch_retries)
