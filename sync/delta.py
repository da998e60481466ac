"""Delta files: the change from one policy version to the next, versioned and self-describing.

Layout (integers little-endian):

    b"LRLDELTA"                 8 bytes
    blobs                       each chunk's coded streams, then carried files, back to back
    manifest                    zstd-compressed JSON (`DeltaManifest`)
    manifest length             u64
    blake3(manifest)            32 bytes
    b"LRLDELTA"                 8 bytes

Every byte is under a hash: each blob's is in the manifest, the manifest's is in the
footer, and the blobs must tile the space between header and manifest exactly. So a
corrupted byte is caught before anything is decoded, and a missing footer means the file
is truncated. After decoding, each tensor is checked against its own hash and the base
against the hash it had when the delta was made: the result is bit-identical to what
the encoder saw, or an error.

Formats (the manifest's `format`; `FORMATS` are those this liverl reads, and a delta is
written in the lowest one that holds it, so a snapshot always reads as format 1):

1. every tensor in independent chunks, each coded on its own (`sync.codec.encode_change`);
2. a tensor changed against its base is coded as a whole, given the base: its values
   split into classes by the base value's exponent, each class with its own statistics
   over the tensor (`sync.codec.ContextEncoder`); one blob per tensor. Tensors new to
   the base are coded as in format 1.

Tensors are coded one by one (each in chunks of `CHUNK_VALUES` values) on a thread pool;
numpy, zstd and blake3 release the GIL, and at most two tensors per thread are in
flight, so memory stays bounded by a few of the largest tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Literal

import blake3
import numpy as np
import torch
import zstandard
from pydantic import BaseModel

from sync.checkpoint import Checkpoint, ShardWriter, bits, dtype_name, dtype_of
from sync.codec import (
    CONTEXT_CHUNK_VALUES,
    ContextEncoder,
    context_classes,
    decode_change,
    decode_context,
    encode_change,
    keep_freed_memory,
)

FORMATS = (1, 2)
LATEST_FORMAT = FORMATS[-1]
MAGIC = b"LRLDELTA"
# Values per independently coded chunk: small enough to stay in cache (encoding at 1M
# values is ~1.5x faster than at 32M), large enough that the manifest stays ~0.1% of a delta.
CHUNK_VALUES = 1 << 20
DEFAULT_SHARD = "model.safetensors"
_FOOTER = struct.Struct("<Q32s8s")

Tensors = Mapping[str, torch.Tensor]
Progress = Callable[[int], None]


class DeltaError(Exception):
    """A delta that cannot be applied; nothing was written."""


class CorruptDeltaError(DeltaError):
    """Bytes of the delta do not match their hash, or its structure is inconsistent."""


class TruncatedDeltaError(CorruptDeltaError):
    """The delta file ends before its footer."""


class UnsupportedFormatError(DeltaError):
    """The delta is written in a format this liverl does not read (a newer learner):
    the replica should fetch a snapshot instead."""


class BaseMismatchError(DeltaError):
    """The weights given as base are not the ones the delta was made against."""


class Blob(BaseModel):
    offset: int
    length: int
    hash: str  # blake3 of the stored bytes


class Chunk(Blob):
    coding: Literal["sparse", "dense", "context"]  # context: the whole tensor (format 2)
    changed: int  # values whose bits changed
    streams: list[int]  # lengths of the zstd frames the blob is made of (0: empty)


class ContextClasses(BaseModel):
    """How a format-2 tensor's values are split by the base value's exponent."""

    bounds: list[int]  # exponent where each class after the first starts
    dense: list[bool]  # per class: every member's difference coded, not the changes'


class TensorEntry(BaseModel):
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: list[int]
    encoding: Literal["same", "delta", "full"]  # full: coded against zeros (new to the base)
    changed: int
    hash: str  # blake3 of the resulting tensor's bytes
    base_hash: str | None  # blake3 of the base tensor's bytes (same, delta)
    file: str | None = None  # safetensors shard in the target directory
    chunks: list[Chunk] = []
    context: ContextClasses | None = None  # format 2: one "context" chunk for the tensor

    @property
    def values(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.values * dtype_of(self.dtype).itemsize


class FileEntry(BaseModel):
    """A non-tensor file of the target directory (config, tokenizer...) that differs."""

    path: str
    hash: str  # blake3 of the file's content
    blob: Blob  # its zstd frame


class DeltaManifest(BaseModel):
    format: int = 1
    base_version: str
    target_version: str
    digest: str  # state_digest of the target tensors
    chunk_values: int
    tensors: list[TensorEntry]
    removed: list[str] = []  # base tensors the target does not have
    shards: dict[str, dict[str, str]] = {}  # target shard -> its safetensors metadata
    files: list[FileEntry] = []
    removed_files: list[str] = []

    @property
    def nbytes(self) -> int:
        """Size of the target tensors."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def changed(self) -> int:
        return sum(t.changed for t in self.tensors)

    @property
    def values(self) -> int:
        return sum(t.values for t in self.tensors)


# --- encoding -----------------------------------------------------------------------------
def encode_delta(old: Tensors | Path, new: Tensors | Path, out: Path | BinaryIO, *,
                 base_version: str, target_version: str, threads: int | None = None,
                 progress: Progress | None = None, format: int = LATEST_FORMAT) -> DeltaManifest:
    """Write the delta that turns `old` into `new` to `out` (a path, written atomically,
    or a binary stream), and return its manifest.

    `old` and `new` are mappings of tensors or safetensors checkpoint directories; for
    directories the target's shard layout and its other files (config, tokenizer) travel
    too. An empty `old` makes a full snapshot. `progress` is called with the bytes of
    each target tensor done. `format` is the highest format it may write (see the
    module doc): 1 for replicas that read no other."""
    if format not in FORMATS:
        raise ValueError(f"format {format} is not one of {FORMATS}")
    old, new = _tensors(old), _tensors(new)
    threads = threads or os.cpu_count() or 1
    keep_freed_memory()
    tensors, files = [], []
    with _output(out) as sink, ThreadPoolExecutor(threads) as pool:
        sink.write(MAGIC)
        offset = len(MAGIC)
        work = lambda name: _encode_tensor(name, old.get(name), new[name], format)  # noqa: E731
        for entry, blobs in _ordered(pool, work, list(new), 2 * threads):
            for chunk, blob in zip(entry.chunks, blobs, strict=True):
                chunk.offset, offset = offset, offset + sink.write(blob)
            entry.file = new.file_of[entry.name] if isinstance(new, Checkpoint) else None
            tensors.append(entry)
            if progress:
                progress(entry.nbytes)
        carried, removed_files = _changed_files(old, new)
        for path, content in carried:
            blob = zstandard.ZstdCompressor(level=3).compress(content)
            files.append(FileEntry(path=path, hash=_hash(content),
                                   blob=Blob(offset=offset, length=len(blob), hash=_hash(blob))))
            offset += sink.write(blob)
        manifest = DeltaManifest(
            format=2 if any(t.context for t in tensors) else 1,
            base_version=base_version, target_version=target_version,
            digest=_digest((t.name, t.dtype, t.shape, t.hash) for t in tensors),
            chunk_values=CHUNK_VALUES, tensors=tensors,
            removed=[name for name in old if name not in new],
            shards=new.metadata if isinstance(new, Checkpoint) else {},
            files=files, removed_files=removed_files)
        raw = zstandard.ZstdCompressor(level=3).compress(manifest.model_dump_json().encode())
        sink.write(raw + _FOOTER.pack(len(raw), blake3.blake3(raw).digest(), MAGIC))
    return manifest


def _encode_tensor(name: str, old: torch.Tensor | None, new: torch.Tensor,
                   format: int) -> tuple[TensorEntry, list[bytes]]:
    comparable = old is not None and old.dtype == new.dtype and old.shape == new.shape
    new_bits, old_bits = bits(new), bits(old) if comparable and old is not None else None
    if format >= 2 and old_bits is not None:
        return _encode_in_context(name, old_bits, new_bits, new)
    new_hash, old_hash = blake3.blake3(), blake3.blake3()
    chunks, blobs = [], []
    for start in range(0, len(new_bits), CHUNK_VALUES):
        part = slice(start, start + CHUNK_VALUES)
        new_hash.update(new_bits[part].view(np.uint8).data)
        if old_bits is not None:
            old_hash.update(old_bits[part].view(np.uint8).data)
        coding, changed, streams = encode_change(None if old_bits is None else old_bits[part], new_bits[part])
        blob = b"".join(streams)
        chunks.append(Chunk(offset=0, length=len(blob), hash=_hash(blob), coding=coding,
                            changed=changed, streams=[len(s) for s in streams]))
        blobs.append(blob)
    changed = sum(c.changed for c in chunks)
    encoding: Literal["full", "delta", "same"] = "full" if old_bits is None else "delta" if changed else "same"
    if encoding == "same":
        chunks, blobs = [], []
    entry = TensorEntry(name=name, dtype=dtype_name(new.dtype), shape=list(new.shape),
                        encoding=encoding, changed=changed if old_bits is not None else len(new_bits),
                        hash=new_hash.hexdigest(),
                        base_hash=None if old_bits is None else old_hash.hexdigest(), chunks=chunks)
    return entry, blobs


def _encode_in_context(name: str, old_bits: np.ndarray, new_bits: np.ndarray,
                       new: torch.Tensor) -> tuple[TensorEntry, list[bytes]]:
    """Format 2: the tensor's change as one blob."""
    dtype = dtype_name(new.dtype)
    bounds, dense = context_classes(dtype, old_bits, new_bits)
    coder = ContextEncoder(dtype, bounds, dense)
    new_hash, old_hash = blake3.blake3(), blake3.blake3()
    changed = 0
    for start in range(0, len(new_bits), CONTEXT_CHUNK_VALUES):
        part = slice(start, start + CONTEXT_CHUNK_VALUES)
        new_hash.update(new_bits[part].view(np.uint8).data)
        old_hash.update(old_bits[part].view(np.uint8).data)
        changed += coder.add(old_bits[part], new_bits[part])
    chunks, blobs, context = [], [], None
    if changed:
        streams = coder.finish()
        blobs = [b"".join(streams)]
        chunks = [Chunk(offset=0, length=len(blobs[0]), hash=_hash(blobs[0]), coding="context",
                        changed=changed, streams=[len(s) for s in streams])]
        context = ContextClasses(bounds=bounds, dense=dense)
    entry = TensorEntry(name=name, dtype=dtype, shape=list(new.shape), encoding="delta" if changed else "same",
                        changed=changed, hash=new_hash.hexdigest(), base_hash=old_hash.hexdigest(),
                        chunks=chunks, context=context)
    return entry, blobs


def _changed_files(old: Tensors, new: Tensors) -> tuple[list[tuple[str, bytes]], list[str]]:
    """The target directory's other files that the base lacks or has with other bytes."""
    if not isinstance(new, Checkpoint):
        return [], []
    old_files = set(old.other_files()) if isinstance(old, Checkpoint) else set()
    carried = []
    for path in new.other_files():
        content = (new.path / path).read_bytes()
        # A path in old_files is one of the base checkpoint's.
        if path not in old_files or not isinstance(old, Checkpoint) or (old.path / path).read_bytes() != content:
            carried.append((path, content))
    return carried, sorted(old_files - set(new.other_files()))


# --- reading and applying ---------------------------------------------------------------
def read_manifest(delta: Path) -> DeltaManifest:
    """The delta's manifest, after checking its framing and hashes (not yet the blobs')."""
    with open(delta, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not MAGIC.startswith(f.read(len(MAGIC))):
            raise CorruptDeltaError(f"{delta} is not a liverl delta")
        if size < len(MAGIC) + _FOOTER.size:
            raise TruncatedDeltaError(f"{delta} is truncated ({size} bytes)")
        f.seek(size - _FOOTER.size)
        length, digest, magic = _FOOTER.unpack(f.read(_FOOTER.size))
        if magic != MAGIC:
            raise TruncatedDeltaError(f"{delta} has no footer: truncated or not completely written")
        start = size - _FOOTER.size - length
        if start < len(MAGIC):
            raise CorruptDeltaError(f"{delta}: manifest length {length} does not fit the file")
        f.seek(start)
        raw = f.read(length)
    if blake3.blake3(raw).digest() != digest:
        raise CorruptDeltaError(f"{delta}: the manifest does not match its hash")
    fields = json.loads(zstandard.ZstdDecompressor().decompress(raw))
    if fields.get("format") not in FORMATS:
        raise UnsupportedFormatError(f"{delta} has format {fields.get('format')}; this liverl reads formats "
                                     f"{', '.join(map(str, FORMATS))}")
    manifest = DeltaManifest.model_validate(fields)
    blobs = sorted([c for t in manifest.tensors for c in t.chunks] + [f.blob for f in manifest.files],
                   key=lambda b: b.offset)
    end = len(MAGIC)
    for blob in blobs:
        if blob.offset != end:
            raise CorruptDeltaError(f"{delta}: blobs do not tile the file at byte {end}")
        end += blob.length
    if end != start or _digest((t.name, t.dtype, t.shape, t.hash) for t in manifest.tensors) != manifest.digest:
        raise CorruptDeltaError(f"{delta}: the manifest is inconsistent")
    return manifest


def iter_apply(old: Tensors | Path, delta: Path, *, expected_base: str | None = None,
               threads: int | None = None) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
    """Yield every target tensor, in the delta's order, decoded from `old` + `delta` and
    verified bit for bit. Raises `BaseMismatchError` if the delta was made against another
    base version than `expected_base` or against other base weights, and
    `CorruptDeltaError` on any corrupted or truncated byte.

    Unchanged tensors are yielded as the base's own tensor objects (no copy)."""
    manifest = read_manifest(delta)
    if expected_base is not None and manifest.base_version != expected_base:
        raise BaseMismatchError(f"{delta} applies to version {manifest.base_version!r}, "
                                f"not {expected_base!r}")
    old = _tensors(old)
    threads = threads or os.cpu_count() or 1
    keep_freed_memory()
    with open(delta, "rb") as f, ThreadPoolExecutor(threads) as pool:
        work = lambda entry: (entry, _decode_tensor(entry, old, f.fileno(), manifest.chunk_values))  # noqa: E731
        yield from _ordered(pool, work, manifest.tensors, 2 * threads)


def apply_delta(old: Tensors | Path, delta: Path, *, expected_base: str | None = None,
                threads: int | None = None) -> dict[str, torch.Tensor]:
    """The target version's tensors, decoded from `old` + `delta` (see `iter_apply`)."""
    return {entry.name: tensor for entry, tensor in
            iter_apply(old, delta, expected_base=expected_base, threads=threads)}


def apply_delta_dir(old: Tensors | Path, delta: Path, out_dir: Path, *,
                    expected_base: str | None = None, threads: int | None = None,
                    progress: Progress | None = None) -> DeltaManifest:
    """Write the target version as a safetensors checkpoint directory `out_dir` (which must
    not exist): the target's shard layout, the base directory's other files updated by the
    delta's. Tensors stream to disk as they are decoded; the directory appears only once
    complete and verified."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    manifest = read_manifest(delta)
    old = _tensors(old)
    partial = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _write_files(old, manifest, delta, partial)
        shards: dict[str, list[TensorEntry]] = {}
        for entry in manifest.tensors:
            shards.setdefault(entry.file or DEFAULT_SHARD, []).append(entry)
        writers = {file: ShardWriter(_inside(partial, file),
                                     [(e.name, dtype_of(e.dtype), e.shape) for e in entries],
                                     manifest.shards.get(file, {"format": "pt"}))
                   for file, entries in shards.items()}
        for entry, tensor in iter_apply(old, delta, expected_base=expected_base, threads=threads):
            writers[entry.file or DEFAULT_SHARD].write(entry.name, tensor)
            if progress:
                progress(entry.nbytes)
        for writer in writers.values():
            writer.close()
        partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _decode_tensor(entry: TensorEntry, old: Tensors, fd: int, chunk_values: int) -> torch.Tensor:
    dtype = dtype_of(entry.dtype)
    base = None
    if entry.encoding != "full":
        base = old.get(entry.name)
        if base is None or base.dtype != dtype or list(base.shape) != entry.shape:
            raise BaseMismatchError(f"{entry.name}: the base has no {entry.dtype} {entry.shape} tensor")
        if entry.encoding == "same":
            if tensor_hash(base) != entry.base_hash:
                raise BaseMismatchError(f"{entry.name} differs from the base the delta was made against")
            return base
    out = torch.empty(entry.shape, dtype=dtype)
    out_bits, base_bits = bits(out), None if base is None else bits(base)
    out_hash = blake3.blake3()
    try:
        for part in _decoded_parts(entry, base_bits, out_bits, fd, chunk_values):
            out_hash.update(out_bits[part].view(np.uint8).data)
    except (ValueError, IndexError, zstandard.ZstdError) as error:  # hash-valid but malformed
        raise CorruptDeltaError(f"{entry.name} cannot be decoded: {error}") from error
    if out_hash.hexdigest() != entry.hash:
        # Every blob matched its hash, so the base is the likely culprit: hashing it only
        # now keeps a second pass over the weights off the normal path.
        if base is not None and tensor_hash(base) != entry.base_hash:
            raise BaseMismatchError(f"{entry.name} differs from the base the delta was made against")
        raise CorruptDeltaError(f"{entry.name}: the decoded tensor does not match its hash")
    return out


def _decoded_parts(entry: TensorEntry, base_bits: np.ndarray | None, out_bits: np.ndarray, fd: int,
                   chunk_values: int) -> Iterator[slice]:
    """Decode `entry` into `out_bits`, yielding each part once written; every value of
    the tensor is written, or this raises ValueError."""
    if entry.context is not None:
        if base_bits is None or [c.coding for c in entry.chunks] != ["context"]:
            raise ValueError("a context-coded tensor needs its base and one context chunk")
        yield from decode_context(entry.dtype, entry.context.bounds, entry.context.dense,
                                  _streams(fd, entry.chunks[0]), base_bits, out_bits, CONTEXT_CHUNK_VALUES)
        return
    if len(entry.chunks) * chunk_values < len(out_bits):
        raise ValueError("the chunks do not cover the tensor")
    for i, chunk in enumerate(entry.chunks):
        part = slice(i * chunk_values, (i + 1) * chunk_values)
        decode_change(None if base_bits is None else base_bits[part], chunk.coding, _streams(fd, chunk),
                      out_bits[part])
        yield part


def _streams(fd: int, chunk: Chunk) -> list[bytes]:
    """A chunk's blob, checked against its hash, cut into its streams."""
    data, streams, start = _read(fd, chunk), [], 0
    for length in chunk.streams:
        streams.append(data[start:start + length])
        start += length
    if start != len(data):
        raise CorruptDeltaError(f"blob at byte {chunk.offset}: its streams do not add up to it")
    return streams


def _write_files(old: Tensors, manifest: DeltaManifest, delta: Path, out_dir: Path) -> None:
    """The target's other files: the base directory's, minus removed, plus carried ones."""
    replaced = {f.path for f in manifest.files} | set(manifest.removed_files)
    if isinstance(old, Checkpoint):
        for path in old.other_files():
            if path not in replaced:
                target = _inside(out_dir, path)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(old.path / path, target)
    with open(delta, "rb") as f:
        for entry in manifest.files:
            content = zstandard.ZstdDecompressor().decompress(_read(f.fileno(), entry.blob))
            if _hash(content) != entry.hash:
                raise CorruptDeltaError(f"{entry.path}: the decoded file does not match its hash")
            target = _inside(out_dir, entry.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)


# --- hashes -------------------------------------------------------------------------------
def tensor_hash(tensor: torch.Tensor) -> str:
    """blake3 of a tensor's raw bytes (C order), as in the manifest."""
    return _hash(bits(tensor).view(np.uint8))


def state_digest(tensors: Tensors | Path, threads: int | None = None) -> str:
    """One hash of a whole set of weights (names, dtypes, shapes, bytes); equal to the
    `digest` of a delta whose target they are. The trainer and a replica compare these."""
    tensors = _tensors(tensors)

    def record(name: str) -> tuple[str, str, list[int], str]:
        tensor = tensors[name]
        return name, dtype_name(tensor.dtype), list(tensor.shape), tensor_hash(tensor)

    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        return _digest(pool.map(record, list(tensors)))


def _digest(records: Iterable[tuple[str, str, list[int], str]]) -> str:
    lines = sorted(f"{name}\t{dtype}\t{list(shape)}\t{h}\n" for name, dtype, shape, h in records)
    return _hash("".join(lines).encode())


def _hash(data) -> str:
    return blake3.blake3(data).hexdigest()


# --- plumbing -----------------------------------------------------------------------------
def _tensors(source: Tensors | Path | str) -> Tensors:
    return Checkpoint(source) if isinstance(source, (str, os.PathLike)) else source


def _read(fd: int, blob: Blob) -> bytes:
    data = os.pread(fd, blob.length, blob.offset)
    if len(data) != blob.length:
        raise TruncatedDeltaError(f"blob at byte {blob.offset} is cut short")
    if _hash(data) != blob.hash:
        raise CorruptDeltaError(f"blob at byte {blob.offset} does not match its hash")
    return data


def _inside(root: Path, relative: str) -> Path:
    """`root / relative`, refusing paths that would leave `root` (from a crafted delta)."""
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
        raise CorruptDeltaError(f"refusing path {relative!r}")
    return root.joinpath(*parts)


def _ordered(pool: Executor, work: Callable, items: Iterable, window: int) -> Iterator:
    """`work` over `items` on `pool`, results in order, at most `window` pending: a slow
    item holds back only `window` results, which bounds memory."""
    pending: deque = deque()
    try:
        for item in items:
            pending.append(pool.submit(work, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


@contextmanager
def _output(out: Path | BinaryIO):
    """A sink whose `write` returns the bytes written; a path appears only when complete."""
    if not isinstance(out, (str, os.PathLike)):
        yield out
        return
    out = Path(out)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        with open(partial, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
