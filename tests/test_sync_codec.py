"""The delta codec: bit-exact round trips of any change, detection of any corruption, in
every delta format this liverl writes (`sync.delta.FORMATS`)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from typer.testing import CliRunner

import sync.delta
from sync import (
    BaseMismatchError,
    Checkpoint,
    CorruptDeltaError,
    apply_delta,
    apply_delta_dir,
    encode_delta,
    read_manifest,
    state_digest,
)
from sync.checkpoint import bits
from sync.cli import app
from sync.codec import decode_change, encode_change
from sync.delta import FORMATS

formats = pytest.mark.parametrize("fmt", FORMATS)

FLOATS = [torch.bfloat16, torch.float16, torch.float32]
OTHERS = [torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn]
# Bit patterns worth having in every base: NaNs with payloads, infinities, zeros of both
# signs, the smallest denormals, the largest finite values.
SPECIAL = {
    2: [0x7FC1, 0xFFC0, 0x7F81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x8001, 0x7F7F, 0x7E01, 0x7C00],
    4: [0x7FC00001, 0xFF800000, 0x7F800000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x7FBFFFFF],
}
# The same per float format: quiet and signalling NaNs with payloads (both signs),
# infinities, signed zeros, the smallest and largest denormals, the largest finite
# values, and the integer extremes of the bit patterns (where a difference wraps).
SPECIAL_OF = {
    torch.bfloat16: [0x7FC1, 0xFFC0, 0x7F81, 0xFFFF, 0x7FFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x8001,
                     0x007F, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80],
    torch.float16: [0x7E01, 0xFE00, 0x7C01, 0xFFFF, 0x7FFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x8001,
                    0x03FF, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00],
    torch.float32: [0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF, 0x7F800000, 0xFF800000,
                    0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000,
                    0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000],
}


def random_tensor(rng: np.random.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Weights-like values for float types with special bit patterns mixed in; random bits otherwise."""
    if dtype in FLOATS:
        tensor = torch.from_numpy(rng.normal(0, 0.02, shape).astype(np.float32)).to(dtype)
        flat = bits(tensor)
        special = np.array(SPECIAL[flat.itemsize], np.uint64).astype(flat.dtype.str.replace("i", "u"))
        where = rng.random(flat.size) < 0.05
        flat[where] = rng.choice(special, int(where.sum())).view(flat.dtype)
        return tensor
    raw = rng.integers(0, 256, (int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,), np.uint8)
    if not raw.size:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        raw &= 1
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def step(rng: np.random.Generator, tensor: torch.Tensor, density: float, kind: str) -> torch.Tensor:
    """A copy with a share `density` of values changed: by a few units in the last place,
    by a sign flip, or to random bits."""
    new = tensor.clone()
    flat = bits(new)
    where = np.flatnonzero(rng.random(flat.size) < density)
    width = flat.dtype.itemsize * 8
    if kind == "ulps":
        flat[where] += rng.choice(np.array([-2, -1, 1, 1, 2, 3], flat.dtype), len(where))
    elif kind == "sign":
        flat[where] ^= np.array(1 << (width - 1), np.uint64).astype(flat.dtype.str.replace("i", "u")).view(flat.dtype)
    else:
        flat[where] = rng.integers(np.iinfo(flat.dtype).min, np.iinfo(flat.dtype).max, len(where), flat.dtype,
                                   endpoint=True)
    if new.dtype == torch.bool:
        flat &= 1
    return new


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Tensors of a few hundred values then span several chunks, as real ones do."""
    monkeypatch.setattr(sync.delta, "CHUNK_VALUES", 97)


changes = st.tuples(st.sampled_from([0.0, 0.001, 0.05, 0.3, 0.8, 1.0]), st.sampled_from(["ulps", "sign", "bits"]))


@formats
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(FLOATS + OTHERS),
       shape=st.sampled_from([(), (0,), (1,), (7, 13), (300,), (3, 5, 41)]), change=changes)
def test_any_change_round_trips(tmp_path_factory, fmt, seed, dtype, shape, change):
    rng = np.random.default_rng(seed)
    old = random_tensor(rng, dtype, shape)
    new = step(rng, old, *change)
    out = io.BytesIO()  # a stream works as well as a path
    manifest = encode_delta({"w": old}, {"w": new}, out, base_version="a", target_version="b", format=fmt)
    path = tmp_path_factory.mktemp("d") / "d.delta"
    path.write_bytes(out.getvalue())
    assert same_bits(apply_delta({"w": old}, path, expected_base="a")["w"], new)
    assert manifest.tensors[0].encoding == ("same" if np.array_equal(bits(old), bits(new)) else "delta")


@formats
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), change=changes)
def test_models_with_new_removed_and_reshaped_tensors(tmp_path_factory, fmt, seed, change):
    rng = np.random.default_rng(seed)
    old = {f"t{i}": random_tensor(rng, dtype, (int(rng.integers(0, 400)),))
           for i, dtype in enumerate(FLOATS + OTHERS)}
    new = {name: step(rng, t, *change) for name, t in old.items() if rng.random() < 0.8}
    new["fresh"] = random_tensor(rng, torch.bfloat16, (33, 3))
    new["t0"] = random_tensor(rng, torch.bfloat16, (5, 5))  # reshaped: coded in full
    new["t1"] = random_tensor(rng, torch.float32, (17,))  # dtype changed: coded in full
    path = tmp_path_factory.mktemp("d") / "d.delta"
    manifest = encode_delta(old, new, path, base_version="a", target_version="b", threads=2, format=fmt)
    result = apply_delta(old, path, threads=2)
    assert list(result) == list(new) and all(same_bits(result[k], new[k]) for k in new)
    assert sorted(manifest.removed) == sorted(set(old) - set(new))
    assert manifest.digest == state_digest(result) == state_digest(new)
    assert {t.name for t in manifest.tensors if t.encoding == "full"} >= {"fresh", "t0", "t1"}


def special_bits(dtype: torch.dtype) -> np.ndarray:
    """`SPECIAL_OF[dtype]` as the signed bit patterns `bits` gives."""
    width = dtype.itemsize
    return np.array(SPECIAL_OF[dtype], np.uint64).astype(f"<u{width}").view(f"<i{width}")


@formats
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(FLOATS), size=st.integers(1, 400),
       share=st.sampled_from([0.01, 0.2, 0.7, 1.0]))
def test_special_values_changing_into_each_other(tmp_path_factory, fmt, seed, dtype, size, share):
    """NaN payloads, infinities, denormals, signed zeros and the largest finite values
    changing into one another, by an ulp across a boundary (the largest finite value to
    infinity, a denormal to a normal, +0 to the smallest denormal) or by a sign flip:
    every pair of special bit patterns round-trips bit for bit."""
    rng = np.random.default_rng(seed)
    special = special_bits(dtype)
    old, new = torch.zeros(size, dtype=dtype), torch.zeros(size, dtype=dtype)
    old_bits, new_bits = bits(old), bits(new)
    old_bits[:] = rng.choice(special, size)
    new_bits[:] = old_bits
    where = rng.random(size) < share
    moves = rng.integers(0, 3, size)  # another special value, +-1 ulp, a sign flip
    sign = np.array(1 << (8 * dtype.itemsize - 1), np.uint64).astype(f"<u{dtype.itemsize}").view(old_bits.dtype)
    ulps = rng.choice(np.array([-2, -1, 1, 2], old_bits.dtype), size)
    changed = np.where(moves == 0, rng.choice(special, size),
                       np.where(moves == 1, old_bits + ulps, old_bits ^ sign))
    new_bits[where] = changed[where]
    path = tmp_path_factory.mktemp("d") / "d.delta"
    encode_delta({"w": old, "same": old.clone()}, {"w": new, "same": old.clone()}, path,
                 base_version="a", target_version="b", format=fmt)
    result = apply_delta({"w": old, "same": old}, path)
    assert same_bits(result["w"], new) and same_bits(result["same"], old)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), width=st.sampled_from([1, 2, 4, 8]), size=st.integers(0, 3000),
       share=st.sampled_from([0.0, 0.0005, 0.01, 0.3, 0.54, 0.56, 0.9, 1.0]),
       kind=st.sampled_from(["ulps", "extremes", "bits"]), fresh=st.booleans())
def test_codec_round_trips_any_integer_change(seed, width, size, share, kind, fresh):
    """`encode_change`/`decode_change` alone, on every element width, around the
    sparse/dense switch, with differences that wrap around the integer range."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(f"<i{width}")
    info = np.iinfo(dtype)
    extremes = np.array([info.min, info.min + 1, -1, 0, 1, info.max - 1, info.max], dtype)
    old = rng.integers(info.min, info.max, size, dtype, endpoint=True)
    if kind == "extremes":
        old = rng.choice(extremes, size)
    new = old.copy()
    where = np.flatnonzero(rng.random(size) < share)
    if kind == "ulps":
        new[where] += rng.choice(np.array([-2, -1, 1, 2], dtype), len(where))  # wraps at the ends
    elif kind == "extremes":
        new[where] = rng.choice(extremes, len(where))
    else:
        new[where] = rng.integers(info.min, info.max, len(where), dtype, endpoint=True)
    base = None if fresh else old
    coding, changed, streams = encode_change(base, new)
    out = np.full(size, 0x55, dtype)  # garbage: every value must be written
    decode_change(base, coding, streams, out)
    assert np.array_equal(out, new)
    assert changed == (size if fresh else int(np.count_nonzero(old != new)))


def test_unknown_coding_and_mismatched_streams_are_refused():
    old = np.arange(1000, dtype=np.int16)
    new = old.copy()
    new[::50] += 1
    coding, _, streams = encode_change(old, new)
    out = np.empty_like(old)
    with pytest.raises(ValueError, match="unknown coding"):
        decode_change(old, "lzw", streams, out)
    with pytest.raises(ValueError):  # the planes of another element width
        decode_change(old.astype(np.int32), coding, streams, np.empty(1000, np.int32))
    with pytest.raises(ValueError):  # a sparse change needs its base
        decode_change(None, coding, streams, out)


@pytest.mark.parametrize("gaps", [[0], [254, 255, 256], [509, 510, 511], [70_000, 0, 255 * 3]])
def test_long_gaps_between_changes(gaps):
    positions = np.cumsum(np.array(gaps) + 1) - 1
    old = np.zeros(positions[-1] + 10, np.int16)
    new = old.copy()
    new[positions] = [-32768, 32767, 1][: len(positions)] + [5] * max(0, len(positions) - 3)
    coding, changed, streams = encode_change(old, new)
    out = np.empty_like(old)
    decode_change(old, coding, streams, out)
    assert (coding, changed) == ("sparse", len(positions)) and np.array_equal(out, new)


def test_sparse_and_dense_codings_are_both_used():
    rng = np.random.default_rng(0)
    old = rng.integers(-(2**15), 2**15, 10_000, dtype=np.int16)
    for density, expected in [(0.04, "sparse"), (0.9, "dense")]:
        new = old + (rng.random(old.size) < density).astype(np.int16)
        coding, _, streams = encode_change(old, new)
        out = np.empty_like(old)
        decode_change(old, coding, streams, out)
        assert coding == expected and np.array_equal(out, new)


def test_full_snapshot_from_nothing(tmp_path):
    """A snapshot has no base to give context, so it is written in format 1 whatever the
    format asked: a replica that cannot read a newer format can always fall back to it."""
    new = {"w": random_tensor(np.random.default_rng(1), torch.bfloat16, (64, 64))}
    manifest = encode_delta({}, new, tmp_path / "full.delta", base_version="", target_version="v1")
    assert manifest.tensors[0].encoding == "full" and read_manifest(tmp_path / "full.delta").format == 1
    assert same_bits(apply_delta({}, tmp_path / "full.delta")["w"], new["w"])


@formats
def test_wrong_base_is_refused(tmp_path, fmt):
    rng = np.random.default_rng(2)
    old = {"a": random_tensor(rng, torch.bfloat16, (500,)), "b": random_tensor(rng, torch.float32, (50,))}
    new = {"a": step(rng, old["a"], 0.1, "ulps"), "b": old["b"].clone()}
    path = tmp_path / "d.delta"
    encode_delta(old, new, path, base_version="v1", target_version="v2", format=fmt)
    with pytest.raises(BaseMismatchError, match="applies to version 'v1'"):
        apply_delta(old, path, expected_base="v0")
    for name in old:  # one flipped bit in a changed or an unchanged tensor
        other = dict(old, **{name: step(rng, old[name], 0.0, "ulps")})
        bits(other[name])[3] ^= 1
        with pytest.raises(BaseMismatchError, match=name):
            apply_delta(other, path)
    with pytest.raises(BaseMismatchError, match="no bfloat16"):
        apply_delta({"b": old["b"]}, path)


def make_checkpoint(path: Path, tensors: dict[str, torch.Tensor], files: dict[str, str]) -> Path:
    """A small sharded Hugging Face style directory."""
    path.mkdir()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, members in shards.items():
        save_file({n: tensors[n].contiguous() for n in members}, path / shard, metadata={"format": "pt"})
    index = {"weight_map": {n: shard for shard, members in shards.items() for n in members}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    for name, text in files.items():
        (path / name).write_text(text)
    return path


@pytest.fixture
def two_versions(tmp_path):
    rng = np.random.default_rng(3)
    old = {f"layers.{i}.w": random_tensor(rng, torch.bfloat16, (40, 30)) for i in range(5)}
    old["norm"] = torch.ones(30, dtype=torch.float32)
    new = {name: step(rng, t, 0.05, "ulps") for name, t in old.items()}
    new["norm"] = old["norm"].clone()
    v1 = make_checkpoint(tmp_path / "v1", old, {"config.json": "{}", "stale.txt": "x"})
    v2 = make_checkpoint(tmp_path / "v2", new, {"config.json": '{"a": 1}', "tokenizer.json": "{}"})
    return v1, v2, new


@formats
def test_checkpoint_directories_round_trip(tmp_path, two_versions, fmt):
    v1, v2, new = two_versions
    manifest = encode_delta(v1, v2, tmp_path / "d.delta", base_version="v1", target_version="v2", format=fmt)
    assert manifest.format == fmt
    assert sorted(f.path for f in manifest.files) == ["config.json", "tokenizer.json"]
    assert manifest.removed_files == ["stale.txt"]
    apply_delta_dir(v1, tmp_path / "d.delta", tmp_path / "out", expected_base="v1")
    out = Checkpoint(tmp_path / "out")
    assert out.file_of == Checkpoint(v2).file_of and out.metadata == Checkpoint(v2).metadata
    assert all(same_bits(out[name], new[name]) for name in new)
    assert sorted(out.other_files()) == sorted(Checkpoint(v2).other_files())
    for name in Checkpoint(v2).other_files():
        assert (tmp_path / "out" / name).read_bytes() == (v2 / name).read_bytes()


@formats
def test_any_corrupted_or_truncated_byte_is_detected(tmp_path, two_versions, fmt):
    v1, v2, _ = two_versions
    good = tmp_path / "d.delta"
    encode_delta(v1, v2, good, base_version="v1", target_version="v2", format=fmt)
    data = good.read_bytes()
    bad = tmp_path / "bad.delta"

    @settings(max_examples=300, deadline=None)
    @given(position=st.integers(0, len(data) - 1), xor=st.integers(1, 255), cut=st.booleans())
    def check(position, xor, cut):
        bad.write_bytes(data[:position] if cut else
                        data[:position] + bytes([data[position] ^ xor]) + data[position + 1:])
        with pytest.raises(CorruptDeltaError):
            apply_delta_dir(v1, bad, tmp_path / "out")
        assert not (tmp_path / "out").exists()

    check()


@pytest.fixture(params=FORMATS)
def mixed_delta(tmp_path, request):
    """A delta with every kind of entry: sparse and dense chunks (format 1) or context
    coded tensors (format 2) of each float dtype, passthrough dtypes, a new tensor (dense
    chunks in every format), a removed one, an unchanged one."""
    rng = np.random.default_rng(4)
    old = {f"{dtype}".removeprefix("torch."): random_tensor(rng, dtype, (300,)) for dtype in FLOATS + OTHERS}
    old["gone"] = random_tensor(rng, torch.bfloat16, (10,))
    new = {name: step(rng, t, density, kind) for (name, t), (density, kind) in
           zip(old.items(), [(0.02, "ulps"), (0.9, "ulps"), (0.3, "sign"), (0.5, "bits")] * 4, strict=False)
           if name != "gone"}
    new["bfloat16"] = old["bfloat16"].clone()
    new["fresh"] = random_tensor(rng, torch.float16, (64,))
    path = tmp_path / "mixed.delta"
    manifest = encode_delta(old, new, path, base_version="a", target_version="b", format=request.param)
    codings = {c.coding for t in manifest.tensors for c in t.chunks}
    encodings = {t.encoding for t in manifest.tensors}
    assert codings == ({"sparse", "dense"} if request.param == 1 else {"context", "dense"})
    assert encodings == {"same", "delta", "full"} and manifest.removed == ["gone"]
    return old, new, path


def test_mixed_delta_round_trips(mixed_delta):
    old, new, path = mixed_delta
    result = apply_delta(old, path, expected_base="a")
    assert list(result) == list(new) and all(same_bits(result[k], new[k]) for k in new)


def test_every_truncation_and_corruption_of_a_mixed_delta_is_detected(tmp_path, mixed_delta):
    """The delta cut at every length, and a flipped byte in the header, the footer, every
    blob and 300 other random places."""
    old, _, path = mixed_delta
    data = path.read_bytes()
    bad = tmp_path / "bad.delta"
    for length in range(len(data)):
        bad.write_bytes(data[:length])
        with pytest.raises(CorruptDeltaError):
            apply_delta(old, bad)
    manifest = read_manifest(path)
    blobs = [c for t in manifest.tensors for c in t.chunks]
    rng = np.random.default_rng(5)
    positions = ([*range(8), *range(len(data) - 48, len(data))] + [b.offset + b.length // 2 for b in blobs]
                 + rng.integers(0, len(data), 300).tolist())
    for position in positions:
        bad.write_bytes(data[:position] + bytes([data[position] ^ int(rng.integers(1, 256))]) + data[position + 1:])
        with pytest.raises(CorruptDeltaError):
            apply_delta(old, bad)


def test_cli_encode_apply_info(tmp_path, two_versions):
    v1, v2, new = two_versions
    runner = CliRunner()
    result = runner.invoke(app, ["encode", str(v1), str(v2), "-o", str(tmp_path / "d.delta")])
    assert result.exit_code == 0, result.output
    assert "ratio" in result.output and "MB/s" in result.output
    result = runner.invoke(app, ["apply", str(v1), str(tmp_path / "d.delta"), "-o", str(tmp_path / "out"),
                                 "--expected-base", "v1"])
    assert result.exit_code == 0, result.output
    assert all(same_bits(Checkpoint(tmp_path / "out")[n], new[n]) for n in new)
    assert read_manifest(tmp_path / "d.delta").target_version == "v2"
    result = runner.invoke(app, ["apply", str(v1), str(tmp_path / "d.delta"), "-o", str(tmp_path / "o2"),
                                 "--expected-base", "v7"])
    assert result.exit_code == 1 and "not 'v7'" in result.output
    assert runner.invoke(app, ["info", str(tmp_path / "d.delta")]).exit_code == 0
    result = runner.invoke(app, ["encode", str(v1), str(v2), "-o", str(tmp_path / "old.delta"), "--format", "1"])
    assert result.exit_code == 0 and read_manifest(tmp_path / "old.delta").format == 1
    assert "format" in runner.invoke(app, ["info", str(tmp_path / "old.delta")]).output
    result = runner.invoke(app, ["encode", str(v1), str(v2), "-o", str(tmp_path / "x.delta"), "--format", "3"])
    assert result.exit_code == 2 and "--format" in result.output  # refused, naming the option
