"""Whoever can write the delta store cannot make a replica write outside its directory:
version and parent names read from the store are version names or nothing."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from test_sync_transport import local_store, replica_on_v0, same_weights

from sync.records import read_records, record_key
from sync.replica import ReplicaSync


def test_a_record_naming_a_path_is_ignored_and_nothing_is_written_outside(tmp_path):
    store = local_store(tmp_path)
    lineage, replica = replica_on_v0(tmp_path, store)
    replica.commit("v0")
    lineage.add()
    lineage.publish(store)
    good = read_records(store)["v1"]
    # A hostile record: its own name and its parent's walk out of the replica's directory.
    hostile = good.model_dump(mode="json") | {"version": "../../escaped", "parent": "../../../escaped-parent"}
    store.put_bytes(record_key("v2"), json.dumps(hostile).encode())

    assert set(read_records(store)) == {"v0", "v1"}  # skipped, not trusted, not fatal
    path, _ = replica.stage("v1")
    assert same_weights(path, lineage.dir("v1"))
    with pytest.raises(ValidationError):
        replica.stage("../../escaped")
    assert not list(tmp_path.rglob("escaped*"))


def test_every_name_that_becomes_a_path_is_a_version_name(tmp_path):
    replica = ReplicaSync(tmp_path / "r0", local_store(tmp_path))
    assert replica.path("v12") == tmp_path / "r0" / "v12"
    for name in ("../v1", "/etc", "v1/../../x", "", "v1\x00", "latest"):
        with pytest.raises(ValidationError):
            replica.path(name)
