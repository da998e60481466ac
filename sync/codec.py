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
import itertools
import math
import threading
from collections.abc import Iterator
from typing import Any, Literal

import numba
import numpy as np
import torch
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


def encode_change(old: np.ndarray | None, new: np.ndarray) -> tuple[Literal["dense", "sparse"], int, list[bytes]]:
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
    """The changed positions back from `_gap_bytes`: a running sum of each byte plus one
    for the change it ends (bytes of 255 end none), less one."""
    steps = gap_bytes.astype(np.int64)
    ends = gap_bytes != 255 if len(gap_bytes) and gap_bytes.max() == 255 else None
    steps += 1 if ends is None else ends  # no long gaps: every byte ends a change
    steps[:1] -= 1
    positions = _running_sum(steps)
    return positions if ends is None else positions[ends]


def _running_sum(steps: np.ndarray) -> np.ndarray:
    """The running sum of int64 `steps`, in place. numpy's takes 2.6 ns a value, torch's
    0.8 (in place on int64: widening inside torch runs on its thread pool, which costs
    40x the time on a busy machine; one running sum is never split across threads)."""
    return torch.from_numpy(steps).cumsum_(0).numpy()


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
    return [_compressor().compress(np.ascontiguousarray(s).data) for s in streams]


def _compressor() -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe; one per thread, reused across chunks.
    if not hasattr(_local, "compressor"):
        _local.compressor = zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS)
    return _local.compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


# --- format 2: the change given what the replica already holds -----------------------------
# The replica applying a delta holds the base, and the base predicts the change: an
# optimizer step moves a weight by an amount in value, so how likely its bits change (and
# by how many units in the last place) depends on the base value's exponent. Small
# weights change far more often than large ones (docs/benchmarks.md, "Delta codec").
#
# So each tensor's values are split into at most `MAX_CLASSES` classes by the base
# value's magnitude (ranges of exponents, chosen per tensor), and each class is coded
# with its own statistics over the whole tensor: the addresses of its changes as gaps
# between them, and its differences. Classes of neighbouring exponents change at similar
# rates, so 4 keep ~94% of the information that one class per exponent would (measured
# on warmed-up Adam steps); and every class costs the decoder passes over the values,
# so fewer are faster. The classes below the last are small: the decoder lists their
# members (one pass over the values for all of them) and a change's address is its rank
# among its class's members. The largest magnitudes form the last class, most of the
# values: a change's address there is its position in the tensor, which costs 1-2% more
# bytes than its rank (the gaps also count the small values between changes) but spares
# the decoder a second pass listing the last class's members to find the rank-th (a
# fifth of its time at lr 1e-5; docs/history.md, "Format 2").

MAX_CLASSES = 4
PLAN_SAMPLE = 1 << 16
PLAN_BLOCKS = 64
# Values per step of the coder: a chunk is hashed while it is in cache, and the kernels'
# lists (up to 40 bytes a value when encoding) stay below the 32 MB that glibc serves from
# the memory it keeps (`keep_freed_memory`).
CONTEXT_CHUNK_VALUES = 1 << 19
# The last class holds at least this share of the values, so that the classes the
# decoder lists are small.
LARGE_MIN = 0.8
# Above this share of changed members a class codes every member's difference.
CONTEXT_DENSE_MIN = 0.4
# (exponent bits, mantissa bits) of each float format: the exponent is the magnitude's
# bits above the mantissa.
FLOAT_LAYOUT = {"bfloat16": (8, 7), "float16": (5, 10), "float32": (8, 23), "float64": (11, 52),
                "float8_e4m3fn": (4, 3), "float8_e5m2": (5, 2)}
_NIBBLE_ESCAPE = 15  # a difference code of 15 or more: the rest goes to the escape stream
_STREAMS_PER_CLASS = 3  # address gaps, difference codes two per byte, escapes


def context_classes(dtype: str, old: np.ndarray, new: np.ndarray) -> tuple[list[int], list[bool]]:
    """(class bounds, dense flags) for a tensor's base and target, from `PLAN_SAMPLE`
    values spread over it in `PLAN_BLOCKS` runs (enough for the statistics; runs, not
    single values, so the sample reads 1/32 of a 2M-value tensor's memory, not all of it).

    A bound is the exponent where a class starts (the first starts at 0); the classes
    are merged from one per exponent, cheapest loss of mask entropy first, until at most
    `MAX_CLASSES` remain. Types without an exponent get one class."""
    if len(old) > PLAN_SAMPLE:
        run = PLAN_SAMPLE // PLAN_BLOCKS
        starts = np.linspace(0, len(old) - run, PLAN_BLOCKS).astype(np.int64)
        sample = (starts[:, None] + np.arange(run)).reshape(-1)
        old, new = np.take(old, sample), np.take(new, sample)
    if dtype not in FLOAT_LAYOUT or not len(old):
        return [], [bool(np.count_nonzero(old != new) > CONTEXT_DENSE_MIN * max(len(old), 1))]
    exponent_bits, mantissa_bits = FLOAT_LAYOUT[dtype]
    exponents = (_magnitude(old) >> mantissa_bits).astype(np.intp)
    counts = np.bincount(2 * exponents + (old != new), minlength=2 << exponent_bits)  # both counts, one pass
    members, changes = counts[0::2] + counts[1::2], counts[1::2]
    # The last class starts at the largest exponent that leaves it `LARGE_MIN` of the values.
    top = int(np.flatnonzero(np.cumsum(members[::-1]) >= LARGE_MIN * len(old))[0])
    top = len(members) - 1 - top
    groups = [[int(e), int(members[e]), int(changes[e])] for e in np.flatnonzero(members[:top])]
    while len(groups) > MAX_CLASSES - 1:
        losses = [_mask_bits(a[1] + b[1], a[2] + b[2]) - _mask_bits(a[1], a[2]) - _mask_bits(b[1], b[2])
                  for a, b in itertools.pairwise(groups)]
        i = int(np.argmin(losses))
        groups[i:i + 2] = [[groups[i][0], groups[i][1] + groups[i + 1][1], groups[i][2] + groups[i + 1][2]]]
    groups.append([top, int(members[top:].sum()), int(changes[top:].sum())])
    return [g[0] for g in groups[1:]], [bool(g[2] > CONTEXT_DENSE_MIN * g[1]) for g in groups]


def _mask_bits(members: int, changes: int) -> float:
    """Entropy in bits of which `changes` of `members` changed (order 0)."""
    p = changes / members if members else 0.0
    return 0.0 if p in (0.0, 1.0) else -members * (p * math.log2(p) + (1 - p) * math.log2(1 - p))


class ContextEncoder:
    """One tensor's change, fed chunk by chunk; `finish` gives the per-class streams."""

    def __init__(self, dtype: str, bounds: list[int], dense: list[bool]):
        self.thresholds = _thresholds(dtype, bounds)
        self.dense = np.array(dense, np.bool_)
        self.ranks = np.zeros(len(dense), np.int64)  # members of each class in earlier chunks
        self.start = 0  # position of the next chunk in the tensor
        self.addresses: list[list[np.ndarray]] = [[] for _ in dense]
        self.codes: list[list[np.ndarray]] = [[] for _ in dense]
        self.scratch: tuple[np.ndarray, np.ndarray] | None = None

    def add(self, old: np.ndarray, new: np.ndarray) -> int:
        """Code one chunk; returns its number of changed values."""
        unsigned = np.dtype(old.dtype.str.replace("i", "u"))
        if self.scratch is None or len(self.scratch[0]) < MAX_CLASSES * len(old) or self.scratch[0].dtype != unsigned:
            self.scratch = np.empty(MAX_CLASSES * len(old), unsigned), np.empty(MAX_CLASSES * len(old), np.int64)
        codes, addresses, counts, changed = _split_chunk(old, new, self.start, self.thresholds, self.dense,
                                                         np.iinfo(old.dtype).max, self.ranks, *self.scratch)
        self.start += len(old)
        code_ends, address_ends = np.cumsum(counts), np.cumsum(np.where(self.dense, 0, counts))
        for c in range(len(self.dense)):
            self.codes[c].append(codes[code_ends[c] - counts[c]:code_ends[c]])
            if not self.dense[c]:
                self.addresses[c].append(addresses[address_ends[c] - counts[c]:address_ends[c]])
        return changed

    def finish(self) -> list[bytes]:
        streams = []
        for c, dense in enumerate(self.dense):
            addresses = np.concatenate(self.addresses[c]) if self.addresses[c] else np.zeros(0, np.int64)
            codes = np.concatenate(self.codes[c]) if self.codes[c] else np.zeros(0, np.uint8)
            streams += [b"" if dense else _pack(_gap_bytes(addresses)), *_code_streams(codes)]
        return streams


def decode_context(dtype: str, bounds: list[int], dense: list[bool], streams: list[bytes],
                   old: np.ndarray, out: np.ndarray, chunk_values: int) -> Iterator[slice]:
    """Write `old` + the coded change into `out`, chunk by chunk, yielding each chunk's
    slice once written (so the caller hashes it while it is in cache)."""
    if len(streams) != _STREAMS_PER_CLASS * len(dense) or len(bounds) + 1 != len(dense):
        raise ValueError("context streams do not match the classes")
    thresholds = _thresholds(dtype, bounds)
    unsigned = np.dtype(out.dtype.str.replace("i", "u"))
    # The kernel reads each class's streams as they are, end to end (gap bytes and pairs
    # of codes in `data`, escapes in `escapes`), with its cursors in `cursors`.
    gaps = [np.frombuffer(_unpack(streams[_STREAMS_PER_CLASS * c]), np.uint8) for c in range(len(dense))]
    pairs = [np.frombuffer(_unpack(streams[_STREAMS_PER_CLASS * c + 1]), np.uint8) for c in range(len(dense))]
    escapes = [_unpack(streams[_STREAMS_PER_CLASS * c + 2]) for c in range(len(dense))]
    if any(len(e) % unsigned.itemsize for e in escapes):
        raise ValueError("escaped differences do not match their stream")
    data = np.concatenate([*gaps, *pairs])
    escaped = np.frombuffer(b"".join(escapes) + bytes(unsigned.itemsize), unsigned)  # a spare 0
    cursors = np.zeros((len(dense), _CURSORS), np.int64)
    nibbles_before = 2 * len(data) - 2 * sum(map(len, pairs))
    for column, end_column, lengths, before in [
            (_GAP, _GAP_END, [len(g) for g in gaps], 0),
            (_NIBBLE, _NIBBLE_END, [2 * len(p) for p in pairs], nibbles_before),
            (_ESCAPE, _ESCAPE_END, [len(e) // unsigned.itemsize for e in escapes], 0)]:
        cursors[:, end_column] = before + np.cumsum(lengths)
        cursors[:, column] = cursors[:, end_column] - lengths
    for c, is_dense in enumerate(dense):
        address, after = (_NO_ADDRESS, 0) if is_dense else _first_address(gaps[c])
        cursors[c, _ADDRESS] = address
        cursors[c, _GAP] += after
    dense_flags, top = np.array(dense, np.bool_), np.iinfo(out.dtype).max
    members = np.empty((MAX_CLASSES + 1) * min(chunk_values, len(out)), np.int32)
    for start in range(0, len(out), chunk_values):
        part = slice(start, start + chunk_values)
        error = _apply_chunk(old[part], out[part], start, thresholds, dense_flags, top, members, data, escaped,
                             cursors)
        if error:
            raise ValueError(_APPLY_ERRORS[error])
        yield part
    # Every stream read to its end; a class's codes may end in one padding code of 0.
    k = cursors
    padding = k[:, _NIBBLE_END] - k[:, _NIBBLE]
    if (k[:, _ESCAPE] != k[:, _ESCAPE_END]).any():
        raise ValueError("escaped differences do not match their stream")
    if ((k[:, _GAP] != k[:, _GAP_END]) | (k[:, _ADDRESS] != _NO_ADDRESS) | (padding > 1)).any() or (
            data[k[padding == 1, _NIBBLE] // 2] >> 4).any():
        raise ValueError("context streams are longer than the tensor")


# The per-value loops of format 2, compiled (numba). Most values are in the last class,
# and one lean pass over the chunk does all they need: their changes, addressed by
# position, and a list of the others; the small classes are split from that list, a fifth
# of the values. No branch on the values (which class, changed or not: coin flips to the
# processor at lr 1e-5), and each class's counters in registers (chosen by selects), not
# in an array indexed by class, which chains every value to the previous one's store
# (twice the time). nogil: the encoder's threads run side by side. cache: compiled once
# per machine and element width (on 2 busy cores: 5 s for the encoder, 0.7 s for the
# decoder; 0.25 s and 0.01 s from the cache), not at each process's first delta.
_JIT: dict[str, Any] = {"nogil": True, "cache": True}


@numba.njit(**_JIT)
def _split_chunk(old, new, start, thresholds, dense, top, ranks, code_room, address_room):  # pragma: no cover
    """(codes, addresses, entries per class, changed values) of one chunk of the change
    `new - old`: the codes of each class end to end, in order of position (for a dense
    class every member's zig-zagged difference, for a sparse one each change's, less
    one), and the addresses of the sparse classes' changes likewise (a change's rank
    among its class's members, `ranks` carried over from earlier chunks; in the last
    class its position, the chunk starting at `start`). `code_room`, `address_room`:
    room for `MAX_CLASSES` times the chunk's values, codes of the unsigned type of
    their width."""
    n, classes = len(old), len(dense)
    last, shift = classes - 1, 64 - 8 * old.itemsize
    low, middle, high = thresholds
    split = thresholds[last - 1] if last else -1  # where the last class starts
    dense_last = dense[last]
    small = np.empty(n, np.int32)
    count_small = count_last = changed = 0
    for i in range(n):
        base = np.int64(old[i])
        difference = ((np.int64(new[i]) - base) << shift) >> shift  # wrapped to the width
        is_small, is_changed = (base & top) < split, difference != 0
        small[count_small] = i
        count_small += is_small
        at = last * n + count_last
        code_room[at] = ((difference << 1) ^ (difference >> 63)) - (not dense_last)
        address_room[at] = start + i
        count_last += (not is_small) & (is_changed | dense_last)
        changed += is_changed
    all_dense = np.zeros(MAX_CLASSES, np.bool_)
    all_dense[:classes] = dense
    rank0, rank1, rank2 = np.concatenate((ranks, np.zeros(MAX_CLASSES - classes, np.int64)))[:3]
    kept0 = kept1 = kept2 = 0
    for s in range(count_small):
        i = small[s]
        base = np.int64(old[i])
        difference = ((np.int64(new[i]) - base) << shift) >> shift
        magnitude = base & top
        c = (magnitude >= low) + (magnitude >= middle) + (magnitude >= high)
        is_dense = all_dense[c]
        at = c * n + (kept0 if c == 0 else kept1 if c == 1 else kept2)
        code_room[at] = ((difference << 1) ^ (difference >> 63)) - (not is_dense)
        address_room[at] = rank0 if c == 0 else rank1 if c == 1 else rank2
        keep = is_dense | (difference != 0)
        kept0 += (c == 0) & keep
        kept1 += (c == 1) & keep
        kept2 += (c == 2) & keep
        rank0 += c == 0
        rank1 += c == 1
        rank2 += c == 2
    ranks[:last] = np.array([rank0, rank1, rank2])[:last]
    counts = np.append(np.array([kept0, kept1, kept2])[:last], count_last)
    codes = np.empty(counts.sum(), code_room.dtype)
    addresses = np.empty(counts[~dense].sum(), np.int64)
    code_at = address_at = 0
    for c in range(classes):
        codes[code_at:code_at + counts[c]] = code_room[c * n:c * n + counts[c]]
        code_at += counts[c]
        if not dense[c]:
            addresses[address_at:address_at + counts[c]] = address_room[c * n:c * n + counts[c]]
            address_at += counts[c]
    return codes, addresses, counts, changed


# Columns of a class's cursors in the decoder: its gap bytes (the next, the end), the
# address of its next change (`_NO_ADDRESS`: none left), its difference codes (the next
# nibble, the end), its escapes (the next, the end) and its members in earlier chunks.
_GAP, _GAP_END, _ADDRESS, _NIBBLE, _NIBBLE_END, _ESCAPE, _ESCAPE_END, _RANK = range(8)
_CURSORS = 8
_NO_ADDRESS = np.iinfo(np.int64).max
_APPLY_ERRORS = {1: "context streams end before the tensor", 2: "escaped differences do not match their stream",
                 3: "context streams end inside a gap"}


@numba.njit(**_JIT)
def _apply_chunk(base, out, start, thresholds, dense, top, members, data, escaped, cursors):  # pragma: no cover
    """Write one chunk of `base` + the change into `out`; 0, or the key of the error in
    `_APPLY_ERRORS`. One pass copies the base and lists the values below the last class
    (and those of the last, if dense); those are split into their classes (into
    `members`, room for `MAX_CLASSES + 1` times the chunk's values); then each class's
    changes are added at its members with those ranks. The last class, if sparse, is not
    listed: its changes' addresses are positions. `cursors` carry over to the next
    chunk; within a class's loop they are locals, in registers."""
    n, classes = len(base), len(dense)
    last = classes - 1
    low, middle, high = thresholds
    split = thresholds[last - 1] if last else -1  # where the last class starts
    small, large = members[MAX_CLASSES * n:], members[last * n:]
    count_small = count_large = 0
    if dense[last]:
        for i in range(n):
            value = base[i]
            out[i] = value
            is_small = (np.int64(value) & top) < split
            small[count_small] = i
            large[count_large] = i
            count_small += is_small
            count_large += not is_small
    else:
        for i in range(n):
            value = base[i]
            out[i] = value
            small[count_small] = i
            count_small += (np.int64(value) & top) < split
    count0 = count1 = count2 = 0
    for s in range(count_small):
        i = small[s]
        magnitude = np.int64(base[i]) & top
        c = (magnitude >= low) + (magnitude >= middle) + (magnitude >= high)
        members[c * n + (count0 if c == 0 else count1 if c == 1 else count2)] = i
        count0 += c == 0
        count1 += c == 1
        count2 += c == 2
    counts = np.append(np.array([count0, count1, count2])[:last], count_large)
    mask = np.int64(-1) if base.itemsize == 8 else np.int64((1 << 8 * base.itemsize) - 1)
    # The codes and gaps are read inline, not by helper functions: numba compiled those
    # (with their branches) into calls many times slower than the loop itself.
    for c in range(classes):
        count, first, is_dense = counts[c], c * n, dense[c]
        g, g_end, address, k, k_end, x, x_end, rank = cursors[c]
        offset = np.int64(not is_dense)  # a sparse class codes its (nonzero) differences less one
        end = start + n if c == last else rank + count  # addresses below fall in this chunk
        m = 0
        while m < count if is_dense else address < end:
            if is_dense:
                p = members[first + m]
                m += 1
            else:  # a rank among the members, or in the last class a position
                p = address - start if c == last else members[first + address - rank]
            if k == k_end:
                return 1
            # Escape `x` is read whether the code needs it or not (`escaped` ends in a
            # spare 0): a branch on the codes took 10 times as long.
            code = np.int64((data[k >> 1] >> ((k & 1) << 2)) & 15)
            escape = code == _NIBBLE_ESCAPE
            code = (code + np.int64(escaped[x]) * escape + offset) & mask
            k += 1
            x += escape
            if x > x_end:
                return 2
            # Un-zig-zagged (a logical shift, also at 64 bits), stored wrapped to the width.
            out[p] = np.int64(out[p]) + (((code >> 1) & _NO_ADDRESS) ^ -(code & 1))
            if not is_dense:  # the next address: bytes of 255 continue a gap (`_gap_bytes`)
                if g == g_end:
                    address = _NO_ADDRESS
                else:
                    gap, byte = 0, 255
                    while byte == 255 and g < g_end:
                        byte = data[g]
                        g += 1
                        gap += byte
                    if byte == 255:
                        return 3
                    address += 1 + gap
        cursors[c, _GAP], cursors[c, _ADDRESS], cursors[c, _NIBBLE], cursors[c, _ESCAPE] = g, address, k, x
        cursors[c, _RANK] = rank + count
    return 0


def _first_address(gaps: np.ndarray) -> tuple[int, int]:
    """(a sparse class's first address, its next gap byte) from its gap bytes."""
    if not len(gaps):
        return _NO_ADDRESS, 0
    ends = int(np.argmax(gaps != 255))
    if gaps[ends] == 255:
        raise ValueError(_APPLY_ERRORS[3])
    return 255 * ends + int(gaps[ends]), ends + 1


def _magnitude(bits: np.ndarray) -> np.ndarray:
    """The bit pattern without its sign: ordered like the value's magnitude."""
    return bits & np.iinfo(bits.dtype).max


def _thresholds(dtype: str, bounds: list[int]) -> np.ndarray:
    """Class bounds as magnitudes: a class starts at the smallest value of its exponent.
    Always `MAX_CLASSES - 1` of them, those of absent classes above every magnitude: the
    kernels then compare with each in turn, unrolled (a loop over a variable number took
    8 times as long)."""
    exponent_bits, mantissa_bits = FLOAT_LAYOUT.get(dtype, (0, 0))
    if bounds and (list(bounds) != sorted(set(bounds)) or bounds[0] <= 0 or bounds[-1] >= 1 << exponent_bits
                   or len(bounds) >= MAX_CLASSES):
        raise ValueError(f"invalid class bounds {bounds} for {dtype}")
    absent = [np.iinfo(np.int64).max] * (MAX_CLASSES - 1 - len(bounds))
    return np.array([b << mantissa_bits for b in bounds] + absent, np.int64)


def _code_streams(codes: np.ndarray) -> list[bytes]:
    """Difference codes (mostly below 4) two per byte, so the entropy coder's at least
    one bit per symbol costs at most half a bit per difference; codes of 15 and more
    keep 15 there and the rest, whole, in an escape stream."""
    nibbles = np.zeros(len(codes) + len(codes) % 2, np.uint8)  # a padding code of 0 if odd
    np.minimum(codes, _NIBBLE_ESCAPE, out=nibbles[:len(codes)], casting="unsafe")
    pairs = nibbles[0::2] | (nibbles[1::2] << 4)
    escapes = np.compress(codes >= _NIBBLE_ESCAPE, codes) - _NIBBLE_ESCAPE  # faster than a boolean index
    return [_pack(pairs), _pack(escapes.view(np.uint8))]


def _pack(data: np.ndarray) -> bytes:
    return _compressor().compress(np.ascontiguousarray(data).data) if len(data) else b""


def _unpack(stream: bytes) -> bytes:
    return _decompressor().decompress(stream) if stream else b""
