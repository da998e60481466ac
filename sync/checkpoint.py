"""Hugging Face safetensors checkpoint directories: read lazily, written tensor by tensor."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

# torch dtype -> safetensors dtype code (the file format's own names).
_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> np.ndarray:
    """The raw bit patterns of a tensor as a flat signed-integer array of its element
    width (elements wider than 8 bytes become several int64 words); no copy for a
    contiguous CPU tensor."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(_INTS[min(flat.element_size(), 8)]).numpy()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class Checkpoint(Mapping[str, torch.Tensor]):
    """A safetensors checkpoint (a Hugging Face model directory or one .safetensors file)
    as a read-only mapping. Each tensor is a zero-copy view of the memory-mapped file,
    so only what is being worked on occupies memory."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors")) if self.path.is_dir() else [self.path]
        if not files or not files[0].is_file():
            raise FileNotFoundError(f"no .safetensors files in {self.path}")
        self._handles = {f.name: safe_open(f, framework="pt") for f in files}
        self.file_of: dict[str, str] = {}
        for file, handle in self._handles.items():
            for name in handle.keys():
                if self.file_of.setdefault(name, file) != file:
                    raise ValueError(f"tensor {name} is in both {self.file_of[name]} and {file}")
        self.metadata = {file: handle.metadata() or {} for file, handle in self._handles.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[self.file_of[name]].get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self.file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)

    def other_files(self) -> list[str]:
        """Relative paths of the directory's other files (config, tokenizer, index...)."""
        if not self.path.is_dir():
            return []
        shards = {self.path / file for file in self._handles}
        return sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*")
                      if p.is_file() and p not in shards)


class ShardWriter:
    """Writes one .safetensors file tensor by tensor, in any order.

    The safetensors library only saves a whole dict at once; knowing every name, dtype
    and shape up front (from the delta's manifest) lets the header be written first and
    each tensor land at its offset as soon as it is decoded, so memory stays bounded by
    the tensors in flight."""

    def __init__(self, path: Path, tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Mapping[str, str] | None = None):
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self._offsets, self._sizes, end = {}, {}, 0
        for name, dtype, shape in tensors:
            size = _nbytes(dtype, shape)
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [end, end + size]}
            self._offsets[name], self._sizes[name] = end, size
            end += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes with spaces
        self._data_start = 8 + len(raw)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, struct.pack("<Q", len(raw)) + raw)
        os.ftruncate(self._fd, self._data_start + end)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        data = bits(tensor).data.cast("B")  # the array's memoryview
        if len(data) != self._sizes[name]:
            raise ValueError(f"{name}: {len(data)} bytes, the header says {self._sizes[name]}")
        offset = self._data_start + self._offsets[name]
        while data:  # pwrite may write less than asked
            written = os.pwrite(self._fd, data, offset)
            data, offset = data[written:], offset + written

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize
