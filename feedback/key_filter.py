"""Which keys the warehouse certainly does not hold, answered without asking it.

The sink's duplicate checks are point lookups in ClickHouse's key tables (event_keys,
sample_latest): about 11 µs of ClickHouse's CPU a key, nearly always to find nothing, since
nearly every row is new. A `KeyFilter` holds a 64-bit hash of every key of one key table
(the first 8 bytes of its MD5, which ClickHouse computes the same), sorted: a key whose hash
is absent is not stored, and only the others (a duplicate, or a collision about once in
2^64 / keys held) are looked up. It costs 8 bytes a stored key (80 MB for ten million)
and a search of log2(keys) steps, whatever the table holds.

It is exact only while it sees every key written: it is loaded from the warehouse, the
sink adds what it stores, and the sink loads it again when its consumer is given partitions
(another sink may have written them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from feedback.warehouse import Warehouse

# The same 8 bytes on both sides: ClickHouse reads them as a little-endian UInt64.
HASH_SQL = "SELECT reinterpretAsUInt64(substring(MD5(key), 1, 8)) FROM {table} FORMAT RowBinary"


def key_hashes(keys: Iterable[str]) -> np.ndarray:
    return np.frombuffer(b"".join(hashlib.md5(k.encode()).digest()[:8] for k in keys), dtype="<u8")


class KeyFilter:
    def __init__(self, held: np.ndarray) -> None:
        self.held = np.sort(held)
        self.added: set[int] = set()  # since the last merge: merging each batch would copy the array

    @classmethod
    def load(cls, warehouse: Warehouse, table: str) -> KeyFilter:
        """Every key `table` (a key table) holds now."""
        return cls(np.frombuffer(warehouse.query_bytes(HASH_SQL.format(table=table)), dtype="<u8"))

    def maybe_stored(self, keys: list[str]) -> list[bool]:
        """For each key: False if it is certainly not stored, True if the warehouse must say."""
        hashes = key_hashes(keys)
        at = np.minimum(np.searchsorted(self.held, hashes), max(len(self.held) - 1, 0))
        found = self.held[at] == hashes if len(self.held) else np.zeros(len(keys), dtype=bool)
        return [bool(f) or int(h) in self.added for f, h in zip(found, hashes, strict=True)]

    def add(self, keys: list[str]) -> None:
        self.added.update(key_hashes(keys).tolist())
        if len(self.added) > max(100_000, len(self.held) // 8):
            self.held = np.union1d(self.held, np.fromiter(self.added, dtype="<u8", count=len(self.added)))
            self.added.clear()
