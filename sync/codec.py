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
import math
import threading
from collections.abc import Iterator

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
# fifth of its time at lr 1e-5; docs/benchmarks.md, "Format 2").

MAX_CLASSES = 4
PLAN_SAMPLE = 1 << 16
PLAN_BLOCKS = 64
# Values per step of the coder: its temporaries stay in cache and in the memory glibc
# keeps, and its ~40 numpy calls are few per value (decode of 2M-value bf16 tensors at lr
# 1e-5: 430 MB/CPU-s at 128k, 450 at 256k, 470 at 512k, 420 at 1M).
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
                  for a, b in zip(groups, groups[1:])]
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
        self.dense = dense
        self.seen = np.zeros(len(dense), np.int64)  # addresses of each class in earlier chunks
        self.addresses: list[list[np.ndarray]] = [[] for _ in dense]
        self.codes: list[list[np.ndarray]] = [[] for _ in dense]

    def add(self, old: np.ndarray, new: np.ndarray) -> int:
        """Code one chunk; returns its number of changed values."""
        changed = np.flatnonzero(old != new)
        difference = new - old  # one pass, then one gather per class instead of two
        members = _Members(old, self.thresholds)
        kind = members.kind(changed)
        for c, dense in enumerate(self.dense):
            if dense:
                where = members.of(c)
                self.codes[c].append(_zigzag(np.take(difference, where)))
            else:
                where = changed if len(self.dense) == 1 else np.compress(kind == c, changed)
                self.addresses[c].append(self.seen[c] + members.address(c, where))
                self.codes[c].append(_zigzag(np.take(difference, where)) - 1)
            self.seen[c] += members.span(c, dense)
        return len(changed)

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
    addresses, codes = [], []
    for c, is_dense in enumerate(dense):
        gaps, pairs, escapes = streams[_STREAMS_PER_CLASS * c:_STREAMS_PER_CLASS * (c + 1)]
        addresses.append(None if is_dense else _positions(np.frombuffer(_unpack(gaps), np.uint8)))
        count = None if is_dense else len(addresses[-1])
        codes.append(_differences(pairs, escapes, out.dtype, count, 0 if is_dense else 1))
    seen = np.zeros(len(dense), np.int64)  # addresses of each class in earlier chunks
    used = np.zeros(len(dense), np.int64)  # codes of each class consumed
    for start in range(0, len(out), chunk_values):
        part = slice(start, start + chunk_values)
        base, target = old[part], out[part]
        target[:] = base
        members = _Members(base, thresholds)
        for c in range(len(dense)):
            span = members.span(c, dense[c])
            if dense[c]:
                where = members.of(c)
            else:
                end = used[c] + int(np.searchsorted(addresses[c][used[c]:], seen[c] + span))
                where = members.select(c, addresses[c][used[c]:end] - seen[c])
            values = codes[c][used[c]:used[c] + len(where)]
            if len(values) != len(where):
                raise ValueError("context streams end before the tensor")
            np.add.at(target, where, values)  # target holds the base; add.at beats an indexed assignment
            used[c] += len(where)
            seen[c] += span
        yield part
    # A dense class's last byte of codes may hold one padding code of 0.
    if any(len(v) - u not in ((0, 1) if d else (0,)) or (len(v) > u and v[-1]) for u, v, d in zip(used, codes, dense)):
        raise ValueError("context streams are longer than the tensor")


class _Members:
    """Which values of one chunk belong to which class, from the base. The classes below
    the last are listed in one pass over the chunk (`small`: their sorted positions;
    `listed`: those of each class; `small_kind`: the class of each small value). The last,
    the largest magnitudes and most of the values, is listed only when a dense last class
    asks for it."""

    def __init__(self, base: np.ndarray, thresholds: np.ndarray):
        self.size = len(base)
        # Compared in the values' own type: a wider scalar would widen every comparison.
        self.thresholds = thresholds.astype(base.dtype)
        self.listed: list[np.ndarray] = []
        self.large: np.ndarray | None = None
        self.magnitude = _magnitude(base)
        if len(thresholds):
            self.is_small = self.magnitude < self.thresholds[-1]
            self.small = np.flatnonzero(self.is_small)
            self.small_kind = self.kind(self.small, small=True)
            self.listed = [self.small] if len(thresholds) == 1 else [
                np.compress(self.small_kind == c, self.small) for c in range(len(thresholds))]  # faster than a boolean index
        else:
            self.small = np.zeros(0, np.int64)

    def kind(self, positions: np.ndarray, small: bool = False) -> np.ndarray:
        """The class of the values at `positions` (`small`: all below the last class)."""
        return _kind(np.take(self.magnitude, positions), self.thresholds[:-1] if small else self.thresholds)

    def count(self, c: int) -> int:
        return len(self.listed[c]) if c < len(self.listed) else self.size - len(self.small)

    def span(self, c: int, dense: bool) -> int:
        """How many addresses class `c` has in this chunk: one per member (`address`),
        but one per value for the sparse last class."""
        return self.size if c == len(self.thresholds) and not dense else self.count(c)

    def of(self, c: int) -> np.ndarray:
        """Positions of class `c`'s members."""
        if c < len(self.listed):
            return self.listed[c]
        if not len(self.thresholds):
            return np.arange(self.size)
        if self.large is None:  # inverted in place: only the last class reads it, and once
            self.large = np.flatnonzero(np.logical_not(self.is_small, out=self.is_small))
        return self.large

    def address(self, c: int, positions: np.ndarray) -> np.ndarray:
        """The addresses in a sparse class's stream of some of class `c`'s members
        (sorted positions): their ranks among the class's members, by bit counts (a
        binary search per position is slower); in the last class, their positions."""
        if c == len(self.thresholds):
            return positions
        among_small = _ranks(self.is_small, positions)
        return among_small if len(self.listed) == 1 else _ranks(self.small_kind == c, among_small)

    def select(self, c: int, addresses: np.ndarray) -> np.ndarray:
        """Positions of the members of class `c` with the (sorted) `addresses`."""
        return addresses if c == len(self.thresholds) else np.take(self.listed[c], addresses)


def _ranks(mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """How many of `mask`'s values are set before each of `positions`: a prefix count of
    set bits per 64 values, plus the set bits below the position in its 64 (a few
    operations per position, where a binary search would take dozens)."""
    packed = np.packbits(mask, bitorder="little")
    words = np.zeros(-(-len(packed) // 8), "<u8")  # whole words (np.pad costs more than the rest)
    words.view(np.uint8)[:len(packed)] = packed
    counts = np.bitwise_count(words)
    before = np.cumsum(counts, dtype=np.int64) - counts
    word = positions >> 6
    below = np.take(words, word) & ((np.uint64(1) << (positions & 63).astype(np.uint64)) - np.uint64(1))
    return np.take(before, word) + np.bitwise_count(below)


def _magnitude(bits: np.ndarray) -> np.ndarray:
    """The bit pattern without its sign: ordered like the value's magnitude."""
    return bits & np.iinfo(bits.dtype).max


def _kind(magnitude: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """The class of each magnitude (a sum of comparisons: faster than a search)."""
    if not len(thresholds):
        return np.zeros(len(magnitude), np.uint8)
    kind = (magnitude >= thresholds[0]).view(np.uint8)
    for threshold in thresholds[1:]:
        kind += magnitude >= threshold
    return kind


def _thresholds(dtype: str, bounds: list[int]) -> np.ndarray:
    """Class bounds as magnitudes: a class starts at the smallest value of its exponent."""
    exponent_bits, mantissa_bits = FLOAT_LAYOUT.get(dtype, (0, 0))
    if bounds and (list(bounds) != sorted(set(bounds)) or bounds[0] <= 0 or bounds[-1] >= 1 << exponent_bits):
        raise ValueError(f"invalid class bounds {bounds} for {dtype}")
    return np.array([b << mantissa_bits for b in bounds], np.int64)


def _code_streams(codes: np.ndarray) -> list[bytes]:
    """Difference codes (mostly below 4) two per byte, so the entropy coder's at least
    one bit per symbol costs at most half a bit per difference; codes of 15 and more
    keep 15 there and the rest, whole, in an escape stream."""
    nibbles = np.zeros(len(codes) + len(codes) % 2, np.uint8)  # a padding code of 0 if odd
    np.minimum(codes, _NIBBLE_ESCAPE, out=nibbles[:len(codes)], casting="unsafe")
    pairs = nibbles[0::2] | (nibbles[1::2] << 4)
    escapes = np.compress(codes >= _NIBBLE_ESCAPE, codes) - _NIBBLE_ESCAPE  # faster than a boolean index
    return [_pack(pairs), _pack(escapes.view(np.uint8))]


def _differences(pairs: bytes, escapes: bytes, dtype: np.dtype, count: int | None, offset: int) -> np.ndarray:
    """The signed differences back from `_code_streams`'s codes (`offset` added, then
    un-zig-zagged); `count` None: as many as the pairs hold (a padding code must then be
    0 and is dropped by the caller's length check).

    Each byte of pairs becomes its two differences in one lookup (a table of 256 pairs):
    a tenth of the passes that unpacking nibbles and un-zig-zagging them would take."""
    signed = np.dtype(dtype)
    unsigned = np.dtype(signed.str.replace("i", "u"))
    packed = np.frombuffer(_unpack(pairs), np.uint8)
    if count is not None and not 0 <= 2 * len(packed) - count <= 1:
        raise ValueError("difference codes do not match the changes")
    table = _pair_table(signed.str, offset)
    differences = np.take(table, packed).view(signed)[:count]
    # The escape code is the only one the table turns into this difference.
    is_escaped = differences == _unzigzag(np.array([_NIBBLE_ESCAPE + offset], unsigned))[0]
    rest = np.frombuffer(_unpack(escapes), unsigned) if escapes else np.zeros(0, unsigned)
    if not len(rest):  # the common case: checking is cheaper than listing
        if is_escaped.any():
            raise ValueError("escaped differences do not match their stream")
        return differences
    escaped = np.flatnonzero(is_escaped)
    if len(rest) != len(escaped):
        raise ValueError("escaped differences do not match their stream")
    differences[escaped] = _unzigzag(rest + unsigned.type(_NIBBLE_ESCAPE + offset))
    return differences


@functools.cache
def _pair_table(signed: str, offset: int) -> np.ndarray:
    """Element b: the differences of the two nibble codes in byte b (low nibble first),
    as one element twice their width (a 1-D take of one wide element is the fastest)."""
    nibbles = np.arange(256)
    codes = np.stack([nibbles & 15, nibbles >> 4], axis=1) + offset
    pairs = np.ascontiguousarray(_unzigzag(codes.astype(np.dtype(signed).str.replace("i", "u"))))
    width = 2 * np.dtype(signed).itemsize
    return pairs.view({2: np.uint16, 4: np.uint32, 8: np.uint64}.get(width, f"V{width}")).reshape(-1)


def _pack(data: np.ndarray) -> bytes:
    return _compressor().compress(np.ascontiguousarray(data)) if len(data) else b""


def _unpack(stream: bytes) -> bytes:
    return _decompressor().decompress(stream) if stream else b""
