"""The change between two versions of one array of bit patterns, and back, bit for bit.

Values are handled as their raw bit patterns viewed as signed integers of the element
width, and the change is the wrapping integer difference `new - old`. That is lossless
for every value (NaN payloads, infinities, denormals, sign flips) and, for an
RL step published in bf16, almost every difference is 0 and the rest are mostly +-1 or
+-2 units in the last place.

Two codings of that difference, chosen by how many values changed (measured in
docs/benchmarks.md, "Delta codec"):

- sparse: the gaps between changed positions (a geometric distribution, one byte each,
  255 as a continuation byte for long gaps), then the changed differences zig-zag coded
  minus one (0 and 1 stand for -1 and +1) and split into byte planes.
- dense: every difference zig-zag coded and split into byte planes.

Each stream is entropy coded by zstd. Its literal Huffman coder already gets close to
the order-0 entropy of these byte streams; match finding only gets in the way (matches
of random +-1 runs cost more than their literals), so the hash table is kept tiny.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np
import zstandard

# Above this share of changed values, coding every difference beats coding gaps.
SPARSE_MAX_DENSITY = 0.55

_ZSTD_PARAMS = zstandard.ZstdCompressionParameters.from_level(1, min_match=7, hash_log=6)
_local = threading.local()


@functools.cache
def keep_freed_memory() -> None:
    """Ask glibc, once per process, to keep freed memory for reuse.

    By default it maps every block above a threshold (128 KB at first) fresh from the
    kernel and hands freed memory back eagerly, so the 1-8 MB temporaries of each chunk
    fault their pages in again: about 40% of the codec's time (docs/benchmarks.md). Blocks
    up to 32 MB now come from the heap, which keeps up to 64 MB free."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD


def encode_change(old: np.ndarray | None, new: np.ndarray) -> tuple[str, int, list[bytes]]:
    """(coding, number of changed values, compressed streams) of `new - old`.

    `old` and `new` are same-length signed integer arrays of bit patterns; `old=None`
    codes `new` against zeros (a tensor the base does not have)."""
    if old is None:
        return "dense", len(new), _compress(_planes(_zigzag(new)))
    changed = np.flatnonzero(old != new)
    if len(changed) > SPARSE_MAX_DENSITY * len(new):
        return "dense", len(changed), _compress(_planes(_zigzag(new - old)))
    differences = np.take(new, changed) - np.take(old, changed)  # take: faster than indexing
    streams = [_gap_bytes(changed)] + _planes(_zigzag(differences) - 1)
    return "sparse", len(changed), _compress(streams)


def decode_change(old: np.ndarray | None, coding: str, streams: list[bytes], out: np.ndarray) -> None:
    """Write `old + change` into the integer array `out` (`old=None` means zeros)."""
    streams = [_decompressor().decompress(s) for s in streams]
    if coding == "dense":
        difference = _unzigzag(_join(streams, out.dtype))
        if old is None:
            out[:] = difference
        else:
            np.add(old, difference, out=out)
    elif coding == "sparse":
        positions = _positions(np.frombuffer(streams[0], np.uint8))
        differences = _unzigzag(_join(streams[1:], out.dtype) + 1)
        if old is None or len(positions) != len(differences) or (len(positions) and positions[-1] >= len(out)):
            raise ValueError("sparse streams do not fit the array")
        out[:] = old
        out[positions] += differences
    else:
        raise ValueError(f"unknown coding {coding!r}")


def _gap_bytes(changed: np.ndarray) -> np.ndarray:
    """Gap g >= 0 before each change as g // 255 bytes of 255 and then g % 255."""
    gaps = np.diff(changed, prepend=-1) - 1
    long = np.flatnonzero(gaps >= 255)
    if not len(long):  # the common case; int64 division is slow, so only where needed
        return gaps.astype(np.uint8)
    continuations = np.zeros(len(gaps), np.int64)
    continuations[long] = gaps[long] // 255
    ends = np.cumsum(continuations + 1) - 1
    out = np.full(ends[-1] + 1, 255, np.uint8)
    out[ends] = gaps - 255 * continuations
    return out


def _positions(gap_bytes: np.ndarray) -> np.ndarray:
    """The changed positions back from `_gap_bytes`."""
    if len(gap_bytes) and gap_bytes.max() == 255:
        ends = gap_bytes != 255  # each change ends with its one byte below 255
        return np.cumsum(gap_bytes + ends, dtype=np.int64)[ends] - 1
    return np.cumsum(gap_bytes, dtype=np.int64) + np.arange(len(gap_bytes))  # no long gaps


def _zigzag(values: np.ndarray) -> np.ndarray:
    """Signed to unsigned with small magnitudes first: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ..."""
    bits = values.dtype.itemsize * 8
    return ((values << 1) ^ (values >> (bits - 1))).view(values.dtype.str.replace("i", "u"))


def _unzigzag(codes: np.ndarray) -> np.ndarray:
    signed = codes.dtype.str.replace("u", "i")
    return ((codes >> 1) ^ (0 - (codes & 1))).view(signed)


def _planes(codes: np.ndarray) -> list[np.ndarray]:
    """Byte planes, least significant first: each plane has its own statistics."""
    width = codes.dtype.itemsize
    return list(codes.view(np.uint8).reshape(-1, width).T.copy())


def _join(planes: list[bytes], dtype: np.dtype) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    if len(planes) != width or len({len(p) for p in planes}) > 1:
        raise ValueError("byte planes do not match the element width")
    stacked = np.stack([np.frombuffer(p, np.uint8) for p in planes], axis=1)
    return stacked.reshape(-1).view(np.dtype(dtype).str.replace("i", "u"))


def _compress(streams: list[np.ndarray]) -> list[bytes]:
    return [_compressor().compress(np.ascontiguousarray(s)) for s in streams]


def _compressor() -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe; one per thread, reused across chunks.
    if not hasattr(_local, "compressor"):
        _local.compressor = zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS)
    return _local.compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor
