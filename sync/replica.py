"""A replica's side of delta sync: plan the cheapest fetch, apply, verify, move into place.

Each replica keeps its own weights under `data_dir/replicas/<replica>/`: a directory
per version it holds (the one it serves and the one before, its rollback target) and
`sync.json` (`ReplicaState`: what it holds, what is pending, bytes fetched). A version
directory appears there by a single rename, after its digest matched the version's
record; fetching and decoding happen in a hidden work directory. So a process killed
mid-apply leaves the old version intact and nothing of the new one visible, and the
next staging removes the leftovers.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from pydantic import BaseModel, Field, TypeAdapter

from liverl.contracts import VersionName
from liverl.faults import crash_point
from liverl.process import alive
from liverl.settings import Settings
from sync.delta import DeltaError, apply_delta_dir, state_digest
from sync.records import StoredObject, VersionRecord, read_records, sync_store
from sync.store import DeltaStore

log = logging.getLogger(__name__)
VERSION = TypeAdapter(VersionName)  # every version name that becomes a path passes it

STATE_FILE = "sync.json"
WORK_PREFIX = ".work-"


class SyncError(Exception):
    """The target cannot be reached from the store, or did not verify."""


class Step(BaseModel):
    base: str | None = Field(description="Version the object applies to; None for a snapshot.")
    target: str
    object: StoredObject


class Plan(BaseModel):
    base: str | None = Field(description="Local version the steps start from; None: a snapshot first.")
    steps: list[Step]

    @property
    def cost(self) -> int:
        return sum(step.object.size for step in self.steps)


class Transfer(BaseModel):
    version: str
    base: str | None = Field(description="Local version the chain started from; None: from a snapshot.")
    objects: list[str] = Field(default_factory=list, description="Store keys fetched, in order.")
    fetched_bytes: int = Field(0, description="Bytes fetched from the store.")
    weights_bytes: int = Field(0, description="Bytes of the version's tensors.")
    fetch_s: float = Field(0.0, description="Fetching and verifying chunks.")
    decode_s: float = Field(0.0, description="Decoding the steps into checkpoint directories.")
    verify_s: float = Field(0.0, description="Checking the result's digest against the record.")
    dirty_base: str | None = Field(None, description="A local base that failed to apply, and why.")


class ReplicaState(BaseModel):
    held: str | None = Field(None, description="Version the replica serves from its own directory.")
    previous: str | None = Field(None, description="The one before, kept for a rollback.")
    pending: str | None = Field(None, description="Target of a staging or swap not yet finished.")
    kept: str | None = Field(None, description="A version kept on disk beside held and previous "
                                               "(a lent replica keeps stable's, to be taken back fast).")
    fetched_bytes: int = Field(0, description="Bytes fetched from the store, all transfers.")
    weights_bytes: int = Field(0, description="Bytes of the versions those transfers delivered.")
    last: Transfer | None = None
    error: str | None = Field(None, description="Why the last staging or swap failed.")
    dirty: list[str] = Field(default_factory=list, description="Local versions found damaged: never a base.")


def plan(records: dict[str, VersionRecord], local: set[str], target: str) -> Plan:
    """The fewest bytes that rebuild `target`: deltas from a version held locally, or the
    nearest snapshot on the target's lineage and the deltas after it."""
    lineage = [target]  # target, its parent, ..., back to the oldest version with a record
    while lineage[-1] in records and (parent := records[lineage[-1]].parent) and len(lineage) <= len(records):
        lineage.append(parent)
    best: Plan | None = None
    chain: list[Step] = []  # deltas from lineage[i] to the target, oldest first
    for i, version in enumerate(lineage):
        options = []
        if version in local:
            options.append(Plan(base=version, steps=chain))
        if version in records and (stored := records[version].snapshot):
            snapshot = Step(base=None, target=version, object=stored)
            options.append(Plan(base=None, steps=[snapshot] + chain))
        for option in options:  # a local chain first: equal cost, nothing to download twice
            if best is None or option.cost < best.cost:
                best = option
        record = records.get(version)
        if record is None or record.delta is None or i + 1 == len(lineage):
            break
        chain = [Step(base=record.parent, target=version, object=record.delta)] + chain
    if best is None:
        raise SyncError(f"{target} cannot be rebuilt from the store or from {sorted(local) or 'nothing'} held")
    return best


class ReplicaSync:
    """One replica's weights directories and sync state."""

    def __init__(self, root: Path, store: DeltaStore):
        self.root = Path(root)
        self.store = store

    @classmethod
    def of(cls, settings: Settings, replica: str) -> ReplicaSync:
        return cls(replicas_dir(settings) / replica, sync_store(settings))

    def path(self, version: str) -> Path:
        return self.root / VERSION.validate_python(version)

    def state(self) -> ReplicaState:
        path = self.root / STATE_FILE
        return ReplicaState.model_validate_json(path.read_text()) if path.exists() else ReplicaState()

    def local_versions(self) -> set[str]:
        """Versions whose directories are in place (complete and verified by construction)."""
        if not self.root.is_dir():
            return set()
        return {p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")}

    def stage(self, target: str) -> tuple[Path, Transfer]:
        """Make `target`'s directory exist, verified, while the replica keeps serving.
        Raises `SyncError`, `StoreError` or `DeltaError`; nothing is then in place."""
        VERSION.validate_python(target)
        self._remove_leftovers()
        self._update(pending=target, error=None)
        state = self.state()
        usable = self.local_versions() - set(state.dirty)
        if target in usable:
            return self.path(target), Transfer(version=target, base=target)
        records = read_records(self.store)
        route = plan(records, usable, target)
        transfer = Transfer(version=target, base=route.base, weights_bytes=records[target].nbytes)
        try:
            self._rebuild(route, records[target], transfer)
        except (DeltaError, SyncError) as error:
            if route.base is None:
                raise
            # The local base is not the version it claims (damaged on disk): never build on
            # it again, and rebuild from a snapshot, as a failed apply should.
            log.warning("%s: applying to the local %s failed (%s); rebuilding from a snapshot",
                        self.root.name, route.base, error)
            self._update(dirty=sorted(set(state.dirty) | {route.base}))
            transfer.dirty_base, transfer.base = f"{route.base}: {error}", None
            self._rebuild(plan(records, set(), target), records[target], transfer)
        state = self.state()
        self._update(last=transfer, fetched_bytes=state.fetched_bytes + transfer.fetched_bytes,
                     weights_bytes=state.weights_bytes + transfer.weights_bytes,
                     dirty=[v for v in state.dirty if v != target])
        return self.path(target), transfer

    def _rebuild(self, route: Plan, record: VersionRecord, transfer: Transfer) -> None:
        """Fetch and apply `route`'s steps in a work directory, check the digest, then move
        the result into place with one rename."""
        work = self.root / f"{WORK_PREFIX}{os.getpid()}"
        work.mkdir(parents=True)
        try:
            current = self.path(route.base) if route.base else None
            for i, step in enumerate(route.steps):
                started = time.perf_counter()
                fetched = self.store.get(step.object.key, work / f"{i}.delta")
                transfer.fetch_s += time.perf_counter() - started
                transfer.fetched_bytes += fetched.stat().st_size
                transfer.objects.append(step.object.key)
                started = time.perf_counter()
                out = work / step.target
                apply_delta_dir(current if current is not None else {}, fetched, out, expected_base=step.base)
                transfer.decode_s += time.perf_counter() - started
                fetched.unlink()
                if current is not None and current.parent == work:
                    shutil.rmtree(current)  # an intermediate version, no longer needed
                current = out
                crash_point("sync.apply_step")
            assert current is not None, "a plan has a local base or at least one step"
            started = time.perf_counter()
            if state_digest(current) != record.digest:
                raise SyncError(f"{record.version}: the rebuilt weights do not match the record's digest")
            transfer.verify_s = time.perf_counter() - started
            crash_point("sync.before_rename")
            shutil.rmtree(self.path(record.version), ignore_errors=True)  # only ever a damaged copy
            current.rename(self.path(record.version))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def keep(self, version: str | None) -> Transfer | None:
        """Stage `version` while the replica serves another and keep it on disk through later
        commits until it is served; one at most (None: keep none). The previously kept
        version's directory goes unless the replica still holds it."""
        try:
            transfer = self.stage(version)[1] if version is not None else None
        except Exception:
            self._update(pending=None)  # nothing was in flight for the replica: it serves on as it did
            raise
        state = self.state()
        self._update(kept=version, pending=None)
        if state.kept not in (None, version, state.held, state.previous):
            shutil.rmtree(self.path(state.kept), ignore_errors=True)
        return transfer

    def commit(self, version: str) -> None:
        """The replica serves `version` now: record it, keep it, the one before and a kept
        version, drop the other directories."""
        state = self.state()
        previous = state.held if state.held != version else state.previous
        kept = None if state.kept == version else state.kept
        self._update(held=version, previous=previous, pending=None, error=None, kept=kept)
        for name in self.local_versions() - {version, previous, kept}:
            shutil.rmtree(self.path(name), ignore_errors=True)

    def abort(self, error: str) -> None:
        """The staging or swap failed; the replica serves what it held."""
        self._update(pending=None, error=error)

    def _update(self, **changes: object) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / STATE_FILE
        partial = path.with_name(f".{STATE_FILE}.partial-{os.getpid()}")
        partial.write_text(self.state().model_copy(update=changes).model_dump_json(indent=2))
        partial.replace(path)  # atomic: a reader never sees half a state

    def _remove_leftovers(self) -> None:
        """Work directories of stagings whose process died (killed mid-apply)."""
        if not self.root.is_dir():
            return
        for path in self.root.glob(f"{WORK_PREFIX}*"):
            pid = path.name.removeprefix(WORK_PREFIX)
            if not pid.isdigit() or int(pid) == os.getpid() or not alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


def replicas_dir(settings: Settings) -> Path:
    return settings.data_dir / "replicas"


def replica_states(settings: Settings) -> dict[str, ReplicaState]:
    """Every replica's sync state, by name."""
    root = replicas_dir(settings)
    if not root.is_dir():
        return {}
    return {p.parent.name: ReplicaState.model_validate_json(p.read_text())
            for p in sorted(root.glob(f"*/{STATE_FILE}"))}
