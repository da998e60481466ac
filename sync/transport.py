"""Publishing policy versions to the delta store: a delta from the parent, now and then a snapshot.

Keys in the store:

    versions/<version>.json    the version's record (`VersionRecord`), written last
    deltas/<version>.delta     parent -> version
    snapshots/<version>.delta  the whole version, coded against nothing

A record says what exists for its version, how large it is and the digest a replica
must end with, so replicas plan a fetch from records alone (`sync.replica`). Snapshots
anchor the delta chains: one every `snapshot_every` versions, one for a version whose
parent the store lacks, and one whenever the delta would be no smaller than a snapshot
(after a large update a replica should not pay more than the full version).
"""

from __future__ import annotations

import logging
from pathlib import Path

from liverl.faults import crash_point
from liverl.settings import Settings
from policies.registry import Registry
from sync.delta import LATEST_FORMAT, encode_delta
from sync.records import (
    StoredObject,
    VersionRecord,
    delta_key,
    read_records,
    snapshot_key,
    sync_store,
    write_record,
)
from sync.retention import collect_garbage
from sync.store import DeltaStore

log = logging.getLogger(__name__)


def publish_version(store: DeltaStore, records: dict[str, VersionRecord], *, version: str, seq: int,
                    model_dir: Path, parent: str | None, parent_dir: Path | None,
                    snapshot_every: int, work_dir: Path, delta_format: int = LATEST_FORMAT) -> VersionRecord:
    """Encode and upload what `version` needs (see the module doc); the record goes last,
    so a listed version is complete. `records` are the store's current ones; the delta is
    written in `delta_format` at most (`sync.delta`)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    try:
        delta = snapshot = None
        if parent is not None and parent_dir is not None:
            files.append(work_dir / f"{version}.delta")
            manifest = encode_delta(parent_dir, model_dir, files[-1], base_version=parent, target_version=version,
                                    format=delta_format)
            delta = StoredObject(key=delta_key(version), size=files[-1].stat().st_size)
        snapshots = [r.snapshot.size for r in sorted(records.values(), key=lambda r: r.seq) if r.snapshot]
        if (delta is None or parent not in records or seq % snapshot_every == 0
                or delta.size >= (snapshots[-1] if snapshots else manifest.nbytes)):
            files.append(work_dir / f"{version}.snapshot")
            manifest = encode_delta({}, model_dir, files[-1], base_version="", target_version=version)
            snapshot = StoredObject(key=snapshot_key(version), size=files[-1].stat().st_size)
            if delta is not None and delta.size >= snapshot.size:
                delta = None
        for stored, path in ((delta, work_dir / f"{version}.delta"), (snapshot, work_dir / f"{version}.snapshot")):
            if stored is not None:
                store.put(stored.key, path)
        record = VersionRecord(version=version, seq=seq, parent=parent, digest=manifest.digest,
                               nbytes=manifest.nbytes, delta=delta, snapshot=snapshot)
        write_record(store, record)
    finally:
        for path in files:
            path.unlink(missing_ok=True)
    return record


def publish_new(store: DeltaStore, registry: Registry, snapshot_every: int, work_dir: Path,
                delta_format: int = LATEST_FORMAT) -> list[VersionRecord]:
    """Publish the registry's versions newer than the store's newest (only the latest one
    into an empty store: older ones nobody will fetch), and stable if the store lacks it (the
    starter is stable when the first version ships; lent replicas keep stable staged from the
    store). Idempotent, so a learner that died between the registry and the store catches up
    on its next version."""
    records = read_records(store)
    newest = max((r.seq for r in records.values()), default=None)
    todo = [v for v in registry.versions() if newest is None or v.seq > newest]
    todo = todo if newest is not None else todo[-1:]
    stable = registry.stable()
    if stable is not None and stable.version not in records and stable.version not in {v.version for v in todo}:
        todo.insert(0, stable)  # first: the newest may then be a delta from it
    published = []
    for version in todo:
        parent_dir = Path(registry.get(version.parent).model_dir) if version.parent else None
        record = publish_version(store, records, version=version.version, seq=version.seq,
                                 model_dir=Path(version.model_dir), parent=version.parent,
                                 parent_dir=parent_dir, snapshot_every=snapshot_every, work_dir=work_dir,
                                 delta_format=delta_format)
        records[record.version] = record
        published.append(record)
    return published


def ship(settings: Settings, registry: Registry) -> list[VersionRecord]:
    """The learner's hook after it published a version: deltas to the store, then
    retention. Never raises: a version the store lacks reaches the replicas as its full
    directory, and the swap records why."""
    try:
        store = sync_store(settings)
        published = publish_new(store, registry, settings.sync.snapshot_every,
                                settings.data_dir / "cache" / "publish", settings.sync.delta_format)
        crash_point("sync.ship.before_retention")
        collect_garbage(settings, store, registry)
    except Exception:
        log.exception("could not ship the new version to the delta store; replicas will load it in full")
        return []
    for record in published:
        log.info("shipped %s: delta %s, snapshot %s bytes, of %s", record.version,
                 record.delta and record.delta.size, record.snapshot and record.snapshot.size, record.nbytes)
    return published
