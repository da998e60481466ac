"""Versions travel to replicas as verified deltas: publish, plan, fetch, apply, retain.

Real parts: the registry (SQLite), the local store and S3 (moto's server on 127.0.0.1),
tiny safetensors checkpoints built here so each test takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import sync.store
from liverl.pool import Pool, Replica, write_pool
from liverl.settings import LocalDeltaStore, S3DeltaStore, Settings, SyncConfig
from policies.registry import Registry
from promotion.promoter import Promoter
from serving.swap import stage
from sync.checkpoint import Checkpoint, bits
from sync.delta import state_digest
from sync.records import StoredObject, VersionRecord, read_records, sync_store
from sync.replica import ReplicaSync, SyncError, plan
from sync.retention import Needs, collect, drop_old_weights, needs
from sync.store import StoreError, open_store
from sync.transport import publish_new, ship

REPO = Path(__file__).resolve().parent.parent


def local_store(tmp_path: Path):
    return open_store(LocalDeltaStore(), tmp_path, retries=2)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, monkeypatch):
    monkeypatch.setattr(sync.store, "CHUNK_BYTES", 4096)  # many chunks from small files
    if request.param == "local":
        return local_store(tmp_path)
    config = S3DeltaStore(endpoint_url=request.getfixturevalue("s3_endpoint"), bucket=f"b-{os.urandom(4).hex()}",
                          access_key_id="test", secret_access_key="test")
    store = open_store(config, tmp_path, retries=2)
    store.client.create_bucket(Bucket=config.bucket)
    return store


class Lineage:
    """Policy versions in a real registry, each a small safetensors directory. A new version
    changes 3% of the bf16 values by one unit in the last place ("sparse", an RL step),
    replaces them with random bits ("random") or renames every tensor and changes the
    config ("renamed": nothing of the parent is reused)."""

    def __init__(self, root: Path, seed: int = 0):
        self.root = root
        self.registry = Registry(root / "policies")
        self.rng = np.random.default_rng(seed)
        self.tensors = {
            "layer.w": torch.from_numpy(self.rng.normal(0, 0.02, (128, 256)).astype(np.float32)).bfloat16(),
            "layer.b": torch.from_numpy(self.rng.normal(0, 1, 256).astype(np.float32)),
        }
        self.add()

    def add(self, change: str = "sparse") -> str:
        if self.registry.latest() is not None:
            w = bits(self.tensors["layer.w"]).copy()
            if change == "sparse":
                changed = self.rng.random(w.size) < 0.03
                w[changed] += self.rng.choice(np.array([-1, 1], dtype=w.dtype), changed.sum())
            elif change == "random":
                w = self.rng.integers(-(1 << 15), 1 << 15, w.size).astype(w.dtype)
            tensors = {"layer.w": torch.from_numpy(w.reshape(128, 256)).view(torch.bfloat16),
                       "layer.b": self.tensors["layer.b"]}
            self.tensors = {f"renamed.{k}" if change == "renamed" else k: v for k, v in tensors.items()}
        staged = self.root / "staging"
        staged.mkdir()
        save_file(self.tensors, staged / "model.safetensors", metadata={"format": "pt"})
        (staged / "config.json").write_text(json.dumps({"model_type": "tiny", "renamed": change == "renamed"}))
        latest = self.registry.latest()
        return self.registry.publish(staged, parent=latest.version if latest else None, window=None,
                                     metrics={}, sample_ids=[], actor="test").version

    def dir(self, version: str) -> Path:
        return Path(self.registry.get(version).model_dir)

    def publish(self, store, snapshot_every: int = 100) -> None:
        publish_new(store, self.registry, snapshot_every, self.root / "publish")


def same_weights(a: Path, b: Path) -> bool:
    left, right = Checkpoint(a), Checkpoint(b)
    return set(left) == set(right) and all(
        left[n].dtype == right[n].dtype and np.array_equal(bits(left[n]), bits(right[n])) for n in left)


def replica_on_v0(tmp_path: Path, store, snapshot_every: int = 100) -> tuple[Lineage, ReplicaSync]:
    """A lineage whose v0 is published, and a replica that staged it."""
    lineage = Lineage(tmp_path)
    lineage.publish(store, snapshot_every=snapshot_every)
    replica = ReplicaSync(tmp_path / "replicas" / "r0", store)
    replica.stage("v0")
    return lineage, replica


def test_chain_apply_is_bit_exact(store, tmp_path):
    lineage, replica = replica_on_v0(tmp_path, store)  # from the snapshot: an empty store starts with one
    replica.commit("v0")
    for _ in range(3):
        lineage.add()
    lineage.publish(store)
    records = read_records(store)
    assert [r.snapshot is not None for r in sorted(records.values(), key=lambda r: r.seq)] == [True] + [False] * 3

    path, transfer = replica.stage("v3")
    assert path == tmp_path / "replicas" / "r0" / "v3"
    assert transfer.base == "v0" and transfer.objects == ["deltas/v1.delta", "deltas/v2.delta", "deltas/v3.delta"]
    assert transfer.fetched_bytes == sum(records[v].delta.size for v in ("v1", "v2", "v3"))
    assert transfer.fetched_bytes < records["v0"].snapshot.size < records["v3"].nbytes
    assert same_weights(path, lineage.dir("v3"))
    assert state_digest(path) == records["v3"].digest == state_digest(lineage.dir("v3"))
    assert json.loads((path / "config.json").read_text())["model_type"] == "tiny"
    replica.commit("v3")
    state = replica.state()
    assert (state.held, state.previous, state.pending) == ("v3", "v0", None)
    assert replica.local_versions() == {"v0", "v3"}
    assert state.fetched_bytes == records["v0"].snapshot.size + transfer.fetched_bytes


def test_a_kept_version_stays_on_disk_through_later_commits_until_it_is_served(tmp_path):
    """A lent replica follows the learner's newest versions but keeps stable's weights, so
    taking it back to stable loads them without fetching or decoding anything."""
    store = local_store(tmp_path)
    lineage, replica = replica_on_v0(tmp_path, store)
    replica.commit("v0")  # stable, served before the lend
    for _ in range(4):
        lineage.add()
    lineage.publish(store)
    assert replica.keep("v0").fetched_bytes == 0  # held already: nothing to stage
    for version in ("v1", "v2", "v3"):  # refreshes while lent
        replica.stage(version)
        replica.commit(version)
    assert replica.local_versions() == {"v0", "v2", "v3"}
    assert replica.state().kept == "v0"

    replica.keep("v1")  # stable changed during the lend: v1 staged now, v0 dropped
    assert replica.local_versions() == {"v1", "v2", "v3"}
    with pytest.raises(SyncError):  # not in the store: nothing changes, nothing is left pending
        replica.keep("v9")
    assert (replica.state().kept, replica.state().pending) == ("v1", None)
    path, transfer = replica.stage("v1")  # the take-back
    assert transfer.fetched_bytes == 0 and transfer.objects == [] and same_weights(path, lineage.dir("v1"))
    replica.commit("v1")
    state = replica.state()
    assert (state.held, state.previous, state.kept, state.pending) == ("v1", "v3", None, None)
    assert replica.local_versions() == {"v1", "v3"}


def test_far_behind_takes_the_smaller_of_chain_and_snapshot(tmp_path):
    store = local_store(tmp_path)
    lineage, replica = replica_on_v0(tmp_path, store, snapshot_every=3)
    for change in ("random", "random", "random", "sparse"):  # v1-v3: large deltas; v3: a snapshot too
        lineage.add(change)
        lineage.publish(store, snapshot_every=3)
    replica.stage("v2")
    records = read_records(store)
    # v1: its delta outgrew v0's snapshot, so it got one too; v3: every third version.
    assert sorted(v for v, r in records.items() if r.snapshot) == ["v0", "v1", "v3"]
    d = {v: r.delta.size for v, r in records.items() if r.delta}

    path, transfer = replica.stage("v4")  # from v2 the chain is smaller than the snapshot
    assert d["v3"] < records["v3"].snapshot.size
    assert transfer.base == "v2" and transfer.objects == ["deltas/v3.delta", "deltas/v4.delta"]
    assert same_weights(path, lineage.dir("v4"))
    far = ReplicaSync(tmp_path / "replicas" / "r1", store)
    far.stage("v0")
    _, transfer = far.stage("v4")  # from v0 the chain costs three large deltas: the snapshot wins
    assert records["v3"].snapshot.size < min(d["v1"], records["v1"].snapshot.size) + d["v2"] + d["v3"]
    assert transfer.base is None and transfer.objects == ["snapshots/v3.delta", "deltas/v4.delta"]
    assert transfer.fetched_bytes == records["v3"].snapshot.size + d["v4"]


def test_a_delta_no_smaller_than_a_snapshot_is_replaced_by_it(tmp_path):
    store = local_store(tmp_path)
    lineage = Lineage(tmp_path)
    lineage.publish(store)
    lineage.add("renamed")  # the delta codes everything a snapshot does, and names what went
    lineage.publish(store)
    record = read_records(store)["v1"]
    assert record.delta is None and record.snapshot is not None
    path, transfer = ReplicaSync(tmp_path / "replicas" / "r0", store).stage("v1")
    assert transfer.objects == ["snapshots/v1.delta"] and same_weights(path, lineage.dir("v1"))


def test_plan_weighs_chain_against_snapshot():
    def record(seq: int, delta: int | None, snapshot: int | None = None) -> VersionRecord:
        return VersionRecord(version=f"v{seq}", seq=seq, parent=f"v{seq - 1}" if seq else None, digest="",
                             nbytes=1000, delta=StoredObject(key=f"d{seq}", size=delta) if delta else None,
                             snapshot=StoredObject(key=f"s{seq}", size=snapshot) if snapshot else None)

    records = {r.version: r for r in [record(0, None, 100), record(1, 60), record(2, 60, 100), record(3, 60)]}
    assert [s.object.key for s in plan(records, {"v0"}, "v3").steps] == ["s2", "d3"]  # 160 < 180
    assert [s.object.key for s in plan(records, {"v1"}, "v3").steps] == ["d2", "d3"]  # 120 < 160
    assert plan(records, {"v3"}, "v3").steps == []
    assert [s.object.key for s in plan(records, set(), "v1").steps] == ["s0", "d1"]
    with pytest.raises(SyncError):
        plan(records, set(), "v9")


@pytest.fixture()
def v1_in_small_chunks(tmp_path, monkeypatch):
    """A replica on v0 and v1 published in 1 KiB chunks, so a delta spans several."""
    monkeypatch.setattr(sync.store, "CHUNK_BYTES", 1024)
    store = local_store(tmp_path)
    lineage, replica = replica_on_v0(tmp_path, store)
    lineage.add()
    lineage.publish(store)
    return store, lineage, replica


def test_corrupted_chunk_is_fetched_again(v1_in_small_chunks, monkeypatch):
    store, lineage, replica = v1_in_small_chunks
    fetches: list[int] = []
    real = store._get_range

    def flaky(key, start, length):  # fault injection: the delta's second chunk arrives corrupted once
        data = real(key, start, length)
        if key == "deltas/v1.delta":
            fetches.append(start)
            if start == 1024 and fetches.count(start) == 1:
                return data[:10] + bytes([data[10] ^ 1]) + data[11:]
        return data

    monkeypatch.setattr(store, "_get_range", flaky)
    path, _ = replica.stage("v1")
    assert fetches.count(1024) == 2 and fetches.count(0) == 1
    assert same_weights(path, lineage.dir("v1"))


def test_corruption_at_rest_leaves_the_old_version(v1_in_small_chunks, tmp_path):
    _, lineage, replica = v1_in_small_chunks
    stored = tmp_path / "deltas" / "deltas" / "v1.delta"
    data = bytearray(stored.read_bytes())
    data[1500] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="corrupted"):
        replica.stage("v1")
    assert replica.local_versions() == {"v0"} and not list(replica.root.glob(".work-*"))
    assert same_weights(replica.path("v0"), lineage.dir("v0"))


STAGE = """
import sys
from pathlib import Path
from liverl.settings import LocalDeltaStore
from sync.replica import ReplicaSync
from sync.store import open_store
root = Path(sys.argv[1])
ReplicaSync(root / "replicas" / "r0", open_store(LocalDeltaStore(), root)).stage(sys.argv[2])
"""


@pytest.mark.parametrize("fault", ["sync.apply_step", "sync.before_rename"])
def test_killed_mid_apply_leaves_old_version_and_no_partial_new(tmp_path, fault):
    store = local_store(tmp_path)
    lineage, replica = replica_on_v0(tmp_path, store)
    replica.commit("v0")
    lineage.add(), lineage.add()
    lineage.publish(store)

    # Fault injection: the staging process dies (os._exit(137), as kill -9) at the named line.
    killed = subprocess.run([sys.executable, "-c", STAGE, str(tmp_path), "v2"], cwd=REPO,
                            env={**os.environ, "LIVERL_FAULT": fault}, capture_output=True)
    assert killed.returncode == 137, killed.stderr.decode()
    assert replica.local_versions() == {"v0"}  # nothing of v1 or v2 is visible
    assert list(replica.root.glob(".work-*"))  # the dead process's leftovers, hidden
    assert state_digest(replica.path("v0")) == read_records(store)["v0"].digest
    assert replica.state().pending == "v2" and replica.state().held == "v0"

    path, _ = replica.stage("v2")  # the next staging cleans up and completes
    assert same_weights(path, lineage.dir("v2"))
    assert not list(replica.root.glob(".work-*"))


def test_retention_keeps_what_replicas_aliases_and_rollback_need(tmp_path):
    store = local_store(tmp_path)
    lineage = Lineage(tmp_path)
    lineage.publish(store, snapshot_every=4)
    for _ in range(11):  # published one by one, as the learner does: snapshots at v0, v4, v8
        lineage.add()
        lineage.publish(store, snapshot_every=4)
    # v6 is stable; v5, the stable before it, is the rollback target.
    lineage.registry.transition("v5", "canary", "test", "offline gate passed")
    lineage.registry.transition("v5", "stable", "test", "promoted")
    lineage.registry.transition("v5", "superseded", "test", "replaced by v6")
    lineage.registry.transition("v6", "canary", "test", "offline gate passed")
    lineage.registry.transition("v6", "stable", "test", "promoted")
    settings = Settings(data_dir=tmp_path, sync=SyncConfig(keep_versions=2))
    holder = ReplicaSync(tmp_path / "replicas" / "r0", store)
    holder.stage("v9")
    holder.commit("v9")
    write_pool(settings, Pool(replicas=[Replica(name="r0", url="http://x", policy_version="v9",
                                                model_dir=str(holder.path("v9")))]))
    wanted = needs(settings, lineage.registry)
    assert wanted.protected == {"v9", "v6", "v5"} and wanted.held == {"v9"}

    result = collect(store, settings.sync.keep_versions, wanted)
    records = read_records(store)
    assert result.kept == ["v4", "v5", "v6", "v8", "v9", "v10", "v11"] == sorted(records, key=lambda v: int(v[1:]))
    assert {v for v, r in records.items() if r.snapshot} == {"v4", "v8"}
    assert {v for v, r in records.items() if r.delta} == {"v5", "v6", "v9", "v10", "v11"}
    assert set(store.list("deltas/")) == {f"deltas/{v}.delta" for v in ("v5", "v6", "v9", "v10", "v11")}
    assert set(store.list("snapshots/")) == {"snapshots/v4.delta", "snapshots/v8.delta"}

    _, transfer = holder.stage("v11")  # the replica still takes the short chain
    assert transfer.objects == ["deltas/v10.delta", "deltas/v11.delta"]
    fresh = ReplicaSync(tmp_path / "replicas" / "r1", store)
    for version in result.kept:  # and everything kept is reachable from nothing
        assert same_weights(fresh.stage(version)[0], lineage.dir(version))
    assert collect(store, 2, Needs(protected=set(), held=set())).kept == ["v8", "v9", "v10", "v11"]

    # The registry's full directories go by the same rule; records and history stay.
    assert drop_old_weights(lineage.registry, 2, wanted) == ["v0", "v1", "v2", "v3", "v4", "v7", "v8"]
    on_disk = {v.version for v in lineage.registry.versions() if Path(v.model_dir).exists()}
    assert on_disk == {"v5", "v6", "v9", "v10", "v11"}
    assert lineage.registry.history("v7")[-1]["actor"] == "retention"
    with pytest.raises(ValueError, match="removed by retention"):
        Promoter(settings, lineage.registry).promote("v7", "test")
    assert lineage.registry.get("v7").state == "candidate"  # nothing was rolled out


def test_publish_new_catches_up_from_an_empty_store(tmp_path):
    store = local_store(tmp_path)
    lineage = Lineage(tmp_path)
    lineage.add(), lineage.add()
    lineage.publish(store)  # an empty store gets only the newest: a snapshot (and the delta from v1)
    records = read_records(store)
    assert list(records) == ["v2"] and records["v2"].snapshot and records["v2"].delta
    lineage.add(), lineage.add()
    lineage.publish(store)  # then every newer version, as deltas
    records = read_records(store)
    assert sorted(records) == ["v2", "v3", "v4"]
    assert records["v3"].delta and records["v4"].delta and not records["v4"].snapshot


def test_an_empty_store_gets_stable_too_so_a_take_back_can_fetch_it(tmp_path):
    """The starter is stable when the learner ships its first version: a lent replica keeps
    stable staged from the store, and a replica without the registry's directories fetches it."""
    store = local_store(tmp_path)
    lineage = Lineage(tmp_path)
    lineage.registry.transition("v0", "canary", "test", "offline gate passed")
    lineage.registry.transition("v0", "stable", "test", "promoted")
    lineage.add(), lineage.add()
    lineage.publish(store)
    records = read_records(store)
    assert sorted(records) == ["v0", "v2"] and records["v0"].snapshot
    replica = ReplicaSync(tmp_path / "replicas" / "replica-0", store)
    weights, _ = replica.stage("v0")
    assert same_weights(weights, lineage.dir("v0"))


def test_ship_publishes_and_retains(tmp_path):
    lineage = Lineage(tmp_path)
    settings = Settings(data_dir=tmp_path, sync=SyncConfig(keep_versions=1, snapshot_every=2))
    assert lineage.registry.root == settings.policies_dir  # the learner's registry
    assert [r.version for r in ship(settings, lineage.registry)] == ["v0"]
    for version in ("v1", "v2", "v3"):
        lineage.add()
        assert [r.version for r in ship(settings, lineage.registry)] == [version]
    records = read_records(sync_store(settings))
    # Kept: the newest, and the snapshot it is rebuilt from; v2's own delta is no longer needed.
    assert sorted(records) == ["v2", "v3"] and records["v2"].snapshot and not records["v2"].delta
    assert sync_store(settings).list("deltas/") == ["deltas/v3.delta"]


def test_swap_stages_from_the_store_or_falls_back_to_the_full_directory(tmp_path):
    settings = Settings(data_dir=tmp_path)
    lineage = Lineage(tmp_path)
    ship(settings, lineage.registry)
    weights, report = stage(settings, "replica-0", "v0", lineage.dir("v0"))
    assert weights == tmp_path / "replicas" / "replica-0" / "v0" and same_weights(weights, lineage.dir("v0"))
    assert report["transport"] == "delta" and report["fetched_bytes"] == read_records(
        sync_store(settings))["v0"].snapshot.size

    lineage.add()  # not shipped: the store has no v1, so the swap loads the registry's directory
    weights, report = stage(settings, "replica-0", "v1", lineage.dir("v1"))
    assert weights == lineage.dir("v1") and "SyncError" in report["sync_error"]
    full = Settings(data_dir=tmp_path, sync=SyncConfig(transport="full"))
    assert stage(full, "replica-0", "v1", lineage.dir("v1")) == (lineage.dir("v1"), {})


def test_sync_cli_status_and_gc(tmp_path):
    from typer.testing import CliRunner

    from app.cli import app

    settings = Settings(data_dir=tmp_path)
    lineage = Lineage(tmp_path)
    for _ in range(3):
        lineage.add()
        ship(settings, lineage.registry)
    replica = ReplicaSync.of(settings, "replica-0")
    replica.stage("v1")
    replica.commit("v1")
    replica.stage("v3")
    runner = CliRunner()
    status = runner.invoke(app, ["sync", "status", "--data-dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert status.exit_code == 0, status.output
    assert "replica-0" in status.output and "v1 -> v3: 2 objects" in status.output
    gc = runner.invoke(app, ["sync", "gc", "--data-dir", str(tmp_path)])
    assert gc.exit_code == 0, gc.output
    assert "kept 3 versions (v1, v2, v3); removed 0 objects" in gc.output


def test_retention_keeps_the_delta_from_a_held_version_the_store_has_no_record_of(tmp_path):
    store = local_store(tmp_path)
    lineage = Lineage(tmp_path)
    lineage.add()
    lineage.publish(store)  # an empty store: v1's snapshot, and its delta from v0
    assert collect(store, 8, Needs(protected={"v0"}, held={"v0"})).removed == []
    assert read_records(store)["v1"].delta  # replicas on v0 still take the small delta
    assert collect(store, 8, Needs(protected=set(), held=set())).removed == ["deltas/v1.delta"]


def test_a_damaged_local_base_is_marked_dirty_and_a_snapshot_is_used(tmp_path):
    store = local_store(tmp_path)
    lineage, replica = replica_on_v0(tmp_path, store, snapshot_every=1)
    replica.commit("v0")
    lineage.add()
    lineage.publish(store, snapshot_every=1)
    weights = replica.path("v0") / "model.safetensors"  # fault injection: a flipped bit on disk
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x10
    weights.write_bytes(bytes(data))

    path, transfer = replica.stage("v1")
    assert transfer.dirty_base.startswith("v0: ") and transfer.base is None
    assert transfer.objects == ["deltas/v1.delta", "snapshots/v1.delta"]
    assert same_weights(path, lineage.dir("v1")) and replica.state().dirty == ["v0"]
    path, transfer = replica.stage("v0")  # never a base again; staged anew, it is whole again
    assert transfer.objects == ["snapshots/v0.delta"] and same_weights(path, lineage.dir("v0"))
    assert replica.state().dirty == []
