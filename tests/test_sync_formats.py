"""Delta formats: format 2 codes each change given the base the replica holds; deltas of
format 1 still apply; a format this liverl does not know is refused, and a replica then
rebuilds the version from a snapshot.

Real parts: the codec, the local delta store, the registry and the replica's staging.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import get_args

import blake3
import numpy as np
import pytest
import torch
import zstandard
from test_sync_transport import Lineage, local_store, same_weights

from liverl.settings import Settings, SyncConfig
from sync import apply_delta, apply_delta_dir, encode_delta, read_manifest
from sync.checkpoint import bits
from sync.codec import ContextEncoder, context_classes, decode_context
from sync.delta import FORMATS, DeltaError, UnsupportedFormatError
from sync.records import read_records, sync_store, write_record
from sync.replica import ReplicaSync
from sync.transport import ship


def adam_versions(size: int, lr: float, steps: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 roundings after steps `steps - 1` and `steps` of Adam on gradients that are a
    fixed normal component plus fresh noise (the benchmark's warmed-up case, small)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(size, generator=generator) * 0.02)
    fixed = torch.randn(size, generator=generator)
    optimizer = torch.optim.Adam([weight], lr=lr)
    versions = []
    for _ in range(steps):
        weight.grad = fixed + torch.randn(size, generator=generator)
        optimizer.step()
        versions.append(weight.detach().bfloat16())
    return versions[-2], versions[-1]


@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_context_coding_is_smaller_than_format_1_on_an_optimizer_step(tmp_path, lr):
    old, new = adam_versions(1 << 20, lr)
    sizes = {}
    for fmt in FORMATS:
        path = tmp_path / f"{fmt}.delta"
        manifest = encode_delta({"w": old}, {"w": new}, path, base_version="a", target_version="b", format=fmt)
        assert manifest.format == fmt
        assert torch.equal(apply_delta({"w": old}, path)["w"].view(torch.int16), new.view(torch.int16))
        sizes[fmt] = path.stat().st_size
    assert sizes[2] < 0.8 * sizes[1]  # about 0.7 measured: the base's exponents pay


def test_a_delta_of_the_previous_format_still_applies(tmp_path):
    """A replica updated to this liverl applies what a learner that writes format 1 made."""
    old, new = adam_versions(50_000, 1e-5)
    path = tmp_path / "d.delta"
    encode_delta({"w": old, "b": old[:10]}, {"w": new, "fresh": new[:7]}, path,
                 base_version="a", target_version="b", format=1)
    manifest = read_manifest(path)
    assert manifest.format == 1 and {c.coding for t in manifest.tensors for c in t.chunks} <= {"sparse", "dense"}
    result = apply_delta({"w": old, "b": old[:10]}, path, expected_base="a")
    assert list(result) == ["w", "fresh"]
    assert np.array_equal(bits(result["w"]), bits(new)) and np.array_equal(bits(result["fresh"]), bits(new[:7]))


def with_format(delta: Path, fmt: int, out: Path) -> Path:
    """`delta` as a newer learner might write it: its manifest says format `fmt`, framed and
    hashed like any other, so only the format can make a reader refuse it."""
    data = delta.read_bytes()
    footer = struct.Struct("<Q32s8s")
    length, _, magic = footer.unpack(data[-footer.size:])
    start = len(data) - footer.size - length
    fields = json.loads(zstandard.ZstdDecompressor().decompress(data[start:start + length]))
    fields["format"] = fmt
    raw = zstandard.ZstdCompressor().compress(json.dumps(fields).encode())
    out.write_bytes(data[:start] + raw + footer.pack(len(raw), blake3.blake3(raw).digest(), magic))
    return out


def test_an_unknown_format_is_refused_cleanly(tmp_path):
    old, new = adam_versions(10_000, 1e-5)
    encode_delta({"w": old}, {"w": new}, tmp_path / "d.delta", base_version="a", target_version="b")
    newer = with_format(tmp_path / "d.delta", max(FORMATS) + 1, tmp_path / "newer.delta")
    with pytest.raises(UnsupportedFormatError, match=f"format {max(FORMATS) + 1}; this liverl reads formats 1, 2"):
        apply_delta_dir({"w": old}, newer, tmp_path / "out")
    assert issubclass(UnsupportedFormatError, DeltaError) and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="format 3 is not one of"):
        encode_delta({"w": old}, {"w": new}, tmp_path / "x.delta", base_version="a", target_version="b", format=3)


def test_a_replica_falls_back_to_the_snapshot_when_it_cannot_read_a_delta(tmp_path):
    store = local_store(tmp_path)
    lineage = Lineage(tmp_path)
    lineage.publish(store, snapshot_every=1)
    replica = ReplicaSync(tmp_path / "replicas" / "r0", store)
    replica.stage("v0")
    replica.commit("v0")
    lineage.add()
    lineage.publish(store, snapshot_every=1)  # v1: a delta from v0 and a snapshot
    record = read_records(store)["v1"]
    newer = with_format(store.get(record.delta.key, tmp_path / "v1.delta"), max(FORMATS) + 1, tmp_path / "n.delta")
    store.put(record.delta.key, newer)
    record.delta.size = newer.stat().st_size
    write_record(store, record)

    path, transfer = replica.stage("v1")  # the delta is fetched, refused, then the snapshot applies
    assert same_weights(path, lineage.dir("v1"))
    assert transfer.objects == ["deltas/v1.delta", "snapshots/v1.delta"] and transfer.base is None


def test_the_setting_offers_every_format_and_defaults_to_the_latest():
    field = SyncConfig.model_fields["delta_format"]
    assert tuple(get_args(field.annotation)) == FORMATS and field.default == FORMATS[-1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_learner_ships_deltas_in_the_format_its_settings_name(tmp_path, fmt):
    """While a replica still runs an older liverl, the learner writes the format it reads."""
    settings = Settings(data_dir=tmp_path, sync=SyncConfig(delta_format=fmt))
    lineage = Lineage(tmp_path)
    ship(settings, lineage.registry)
    lineage.add()
    record, = ship(settings, lineage.registry)
    delta = sync_store(settings).get(record.delta.key, tmp_path / "v1.delta")
    assert read_manifest(delta).format == fmt
    apply_delta_dir(lineage.dir("v0"), delta, tmp_path / "v1")
    assert same_weights(tmp_path / "v1", lineage.dir("v1"))


def test_context_decoding_refuses_streams_that_do_not_fit():
    """Hash-valid but inconsistent streams (a faulty encoder) raise ValueError, which the
    delta reader reports as a corrupt delta; they never write out of bounds."""
    old, new = (bits(t) for t in adam_versions(5000, 1e-5))
    bounds, dense = context_classes("bfloat16", old, new)
    coder = ContextEncoder("bfloat16", bounds, dense)
    coder.add(old, new)
    streams = coder.finish()
    out = np.empty_like(old)
    list(decode_context("bfloat16", bounds, dense, streams, old, out, 1000))  # chunks unlike the encoder's
    assert np.array_equal(out, new)
    for base in (old[:4000], np.concatenate([old, old])):  # streams for another tensor size
        with pytest.raises(ValueError):
            list(decode_context("bfloat16", bounds, dense, streams, base, np.empty_like(base), 1000))
    with pytest.raises(ValueError):
        list(decode_context("bfloat16", bounds, dense, streams[:-1], old, out, 1000))
    with pytest.raises(ValueError):
        list(decode_context("bfloat16", [300], [False, False], streams[:6], old, out, 1000))


@pytest.mark.parametrize("bounds", [[], [120], [117, 119], [116, 118, 120]])
def test_every_class_layout_round_trips(bounds):
    """Each class sparse or dense, the last one included (its changes addressed by position,
    the others' by rank among their members), decoded in chunks unlike the encoder's."""
    old, new = (bits(t) for t in adam_versions(30_000, 1e-4))
    classes = len(bounds) + 1
    for flags in range(1 << classes):
        dense = [bool(flags >> c & 1) for c in range(classes)]
        coder = ContextEncoder("bfloat16", bounds, dense)
        for start in range(0, len(old), 7000):
            coder.add(old[start:start + 7000], new[start:start + 7000])
        out = np.empty_like(old)
        list(decode_context("bfloat16", bounds, dense, coder.finish(), old, out, 4096))
        assert np.array_equal(out, new), dense


def test_escaped_differences_must_match_their_stream():
    """A difference code of 15 sends the rest of the difference to the escape stream: a
    stream with too few or too many escapes is refused, not read past."""
    old = bits(torch.randn(4000, generator=torch.Generator().manual_seed(0)).bfloat16())
    new = old.copy()
    new[::3] += np.arange(len(new[::3]), dtype=np.int16) % 40  # differences up to 39: some escaped
    coder = ContextEncoder("bfloat16", [], [False])
    coder.add(old, new)
    gaps, pairs, escapes = coder.finish()
    assert escapes
    out = np.empty_like(old)
    list(decode_context("bfloat16", [], [False], [gaps, pairs, escapes], old, out, 1000))
    assert np.array_equal(out, new)
    more = zstandard.ZstdCompressor().compress(zstandard.ZstdDecompressor().decompress(escapes) * 2)
    for wrong in (b"", more):
        with pytest.raises(ValueError, match="escaped"):
            list(decode_context("bfloat16", [], [False], [gaps, pairs, wrong], old, out, 1000))
