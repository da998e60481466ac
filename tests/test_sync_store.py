"""Delta stores, local and S3 (moto's server on 127.0.0.1): one interface, chunks verified."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import sync.store
from liverl.settings import LocalDeltaStore, S3DeltaStore
from sync import BaseMismatchError, apply_delta, encode_delta
from sync.checkpoint import bits
from sync.store import StoreError, open_store


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, monkeypatch):
    monkeypatch.setattr(sync.store, "CHUNK_BYTES", 1000)  # many chunks from small files
    if request.param == "local":
        return open_store(LocalDeltaStore(), tmp_path)
    endpoint = request.getfixturevalue("s3_endpoint")
    config = S3DeltaStore(endpoint_url=endpoint, bucket=f"b-{os.urandom(4).hex()}", prefix="liverl/",
                          access_key_id="test", secret_access_key="test")
    store = open_store(config, tmp_path)
    store.client.create_bucket(Bucket=config.bucket)
    return store


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 4321])
def test_put_get_list_delete(store, tmp_path, size):
    source = tmp_path / "source"
    source.write_bytes(os.urandom(size))
    store.put("policies/v2.delta", source)
    store.put("policies/v1.delta", source)
    assert store.list() == ["policies/v1.delta", "policies/v2.delta"]
    assert store.list("policies/v2") == ["policies/v2.delta"]
    assert store.get("policies/v2.delta").read_bytes() == source.read_bytes()
    assert store.get("policies/v1.delta", tmp_path / "here").read_bytes() == source.read_bytes()
    store.delete("policies/v1.delta")
    assert store.list() == ["policies/v2.delta"]
    with pytest.raises(StoreError, match="no object"):
        store.get("policies/v1.delta")


def test_objects_without_index_are_not_listed(store):
    store._put("half-written.delta", b"x")  # the data is there, the index is not yet
    assert store.list() == []
    with pytest.raises(ValueError):
        store.put("../escape", __file__)


def test_corrupted_or_short_chunks_are_fetched_again(store, tmp_path, monkeypatch):
    source = tmp_path / "source"
    source.write_bytes(os.urandom(5500))
    store.put("v.delta", source)
    fetches: list[int] = []
    real = store._get_range

    def flaky(key, start, length):  # chunk 1 arrives corrupted, chunk 3 cut short, once each
        data = real(key, start, length)
        fetches.append(start)
        if fetches.count(start) == 1 and start == 1000:
            return bytes([data[0] ^ 0x40]) + data[1:]
        if fetches.count(start) == 1 and start == 3000:
            return data[:-7]
        return data

    monkeypatch.setattr(store, "_get_range", flaky)
    assert store.get("v.delta").read_bytes() == source.read_bytes()
    assert sorted(fetches) == [0, 1000, 1000, 2000, 3000, 3000, 4000, 5000]


def test_corruption_at_rest_is_an_error(store, tmp_path):
    source = tmp_path / "source"
    source.write_bytes(os.urandom(3000))
    store.put("v.delta", source)
    data = source.read_bytes()  # one byte flipped (set to 0, a random byte that was 0 already stayed intact)
    store._put("v.delta", data[:1500] + bytes([data[1500] ^ 0xFF]) + data[1501:])
    with pytest.raises(StoreError, match="chunk at byte 1000 is corrupted"):
        store.get("v.delta")
    assert not store.cache_dir.joinpath("v.delta").exists()


def test_publish_fetch_apply(store, tmp_path):
    rng = np.random.default_rng(0)
    old = {"w": torch.from_numpy(rng.normal(0, 0.02, (300, 100)).astype(np.float32)).bfloat16()}
    new = {"w": (old["w"].float() - 1e-5 * torch.sign(torch.randn(300, 100))).bfloat16()}
    encode_delta(old, new, tmp_path / "v2.delta", base_version="v1", target_version="v2")
    store.put("v2.delta", tmp_path / "v2.delta")
    fetched = store.get("v2.delta")
    assert np.array_equal(bits(apply_delta(old, fetched, expected_base="v1")["w"]), bits(new["w"]))
    with pytest.raises(BaseMismatchError):
        apply_delta(old, fetched, expected_base="v0")
