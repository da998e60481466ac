"""Retention of the delta store and of the registry's full version directories: keep the
newest versions and whatever is still needed.

Kept: the `keep_versions` newest versions; every version a replica holds, is staging
or keeps for rollback; the registry's aliases (stable, canary), the rollback
targets (the last `promotion.slide_lookback` stable versions before the current one) and
the version the learner was last put back on. For each kept version the store
keeps what rebuilds it: the nearest snapshot on its lineage and the deltas after it,
and the deltas from any version a replica holds, so that replica still takes the
short chain. Everything else goes: records first, so no reader plans with an object
that is about to disappear. (A replica already fetching such an object fails its
staging and loads the registry's full directory; the swap records why.)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, Field

from liverl.pool import read_pool
from liverl.settings import Settings
from policies.registry import PolicyVersion, Registry
from sync.records import (
    OBJECT_PREFIXES,
    VersionRecord,
    read_records,
    record_key,
    write_record,
)
from sync.replica import replica_states
from sync.store import DeltaStore


class Needs(BaseModel):
    protected: set[str] = Field(description="Versions that must stay reachable.")
    held: set[str] = Field(description="Versions replicas hold locally (their chains are kept too).")


class Collected(BaseModel):
    kept: list[str] = Field(description="Versions whose records remain.")
    removed: list[str] = Field(description="Store keys deleted.")
    weights_removed: list[str] = Field(default_factory=list,
                                       description="Versions whose full directories left the registry.")


def needs(settings: Settings, registry: Registry) -> Needs:
    """What replicas, aliases and rollback targets need, from the pool, the replicas'
    sync states and the registry."""
    held = {r.policy_version for r in read_pool(settings).replicas}
    pending = set()
    for state in replica_states(settings).values():
        held |= {v for v in (state.held, state.previous) if v}
        pending |= {state.pending} if state.pending else set()
    aliases = {v.version for v in registry.versions() if v.state in ("stable", "canary")} | set(
        registry.aliases().values())  # and what a team named
    stables = [e["version"] for e in registry.history() if e["to"] == "stable"]
    current = registry.stable()
    # The slide guard may put back any of the last few stables (promotion.slide_lookback).
    rollback = [v for v in stables if current is None or v != current.version][-settings.promotion.slide_lookback:]
    rewind = registry.last_rewind()  # the learner continues from it: its weights (and Adam state) stay
    rewound = {rewind.version} if rewind is not None else set()
    return Needs(protected=held | pending | aliases | set(rollback) | rewound, held=held)


def newest(versions: Iterable[VersionRecord | PolicyVersion], keep_versions: int) -> set[str]:
    """The `keep_versions` newest, by sequence number."""
    return {v.version for v in sorted(versions, key=lambda v: v.seq)[-keep_versions:]}


def retained(records: dict[str, VersionRecord], keep_versions: int, needs: Needs) -> dict[str, VersionRecord]:
    """The records to keep, each trimmed to the objects still needed."""
    wanted = newest(records.values(), keep_versions) | (needs.protected & set(records))
    kept = set(wanted)  # wanted versions and those on their way
    deltas: set[str] = set()  # versions whose delta (from their parent) is kept
    snapshots: set[str] = set()
    for version in wanted:
        lineage = [version]  # back to the oldest record, and its parent (held, maybe, without one)
        while lineage[-1] in records and (parent := records[lineage[-1]].parent) and len(lineage) <= len(records):
            lineage.append(parent)
        anchor = next((i for i, v in enumerate(lineage) if v in records and records[v].snapshot), None)
        if anchor is not None:
            snapshots.add(lineage[anchor])
        reach = max([len(lineage) - 1 if anchor is None else anchor]
                    + [i for i, v in enumerate(lineage) if v in needs.held])
        deltas |= set(lineage[:reach])  # the delta of each version on the way from the base
        kept |= {v for v in lineage[:reach + 1] if v in records}
    return {v: records[v].model_copy(update={"delta": records[v].delta if v in deltas else None,
                                              "snapshot": records[v].snapshot if v in snapshots else None})
            for v in kept}


def collect(store: DeltaStore, keep_versions: int, needs: Needs) -> Collected:
    records = read_records(store)
    keep = retained(records, keep_versions, needs)
    keys = set()
    for version, record in keep.items():
        if record != records[version]:
            write_record(store, record)  # before its objects go: no reader plans with them
        keys |= {record_key(version)} | {o.key for o in (record.delta, record.snapshot) if o}
    removed = [record_key(v) for v in records if v not in keep]
    # Then the objects no kept record names, including leftovers of an interrupted run.
    removed += [k for prefix in OBJECT_PREFIXES for k in store.list(prefix) if k not in keys]
    for key in removed:
        store.delete(key)
    return Collected(kept=sorted(keep, key=lambda v: keep[v].seq), removed=removed)


def drop_old_weights(registry: Registry, keep_versions: int, needs: Needs) -> list[str]:
    """The registry's full directories by the same rule: the newest and what is needed stay."""
    versions = registry.versions()
    kept = newest(versions, keep_versions) | needs.protected
    dropped = []
    for version in versions:
        if version.version not in kept and Path(version.model_dir).exists():
            registry.drop_weights(version.version, f"older than the newest {keep_versions} and not needed")
            dropped.append(version.version)
    return dropped


def collect_garbage(settings: Settings, store: DeltaStore, registry: Registry) -> Collected:
    wanted = needs(settings, registry)
    collected = collect(store, settings.sync.keep_versions, wanted)
    collected.weights_removed = drop_old_weights(registry, settings.sync.keep_versions, wanted)
    return collected
