"""Retention for the embedded broker's log, which Tansu 0.6 does not apply on its S3 engine.

Tansu 0.6 on S3 keeps every batch forever: it reads no `retention.ms` nor
`retention.bytes`, its DeleteRecords is unimplemented (`todo!()`) and its periodic
maintenance does nothing. So the store (app.broker_store) deletes whole batch objects
itself, from Tansu's layout: `clusters/C/topics/T/partitions/P/records/<base offset>.batch`
(a Kafka record batch, v2), the topics' configs in `clusters/C/meta.json`, and each
group's committed offset in `clusters/C/groups/consumers/G/offsets/T/partitions/P.json`.

- `cleanup.policy=delete` (the default): the oldest batches, older than `retention_s` (or
  while the partition holds more than `retention_bytes`, or more batches than
  `retention_batches`), from the front only, so the log start moves forward and never
  leaves a hole. The count matters most here: Tansu's Fetch lists every batch object of
  the partition each time (dynostore.rs `fetch`), so a fetch costs in proportion to them.
- `cleanup.policy=compact` (the stream's changelog, which a table restore reads whole):
  no age limit; a batch goes only once each of its keys has a later record, or its
  record is a tombstone with nothing older of its key left. A restore reads the same table.
- Never what a consumer group has not read: no batch at or past the lowest offset any
  group committed on its partition. A group nobody uses any more holds the log until it
  is deleted (AdminClient.delete_consumer_groups); a topic no group reads (the dead
  letters) has time retention only, as in Kafka.
- Never a partition's newest batch: Tansu answers ListOffsets(latest) from its newest
  object, so a partition left empty would answer 0.

Afterwards the partition's `watermark.json` gets the new first offset as `low`, which
Tansu's Fetch answers as the log start offset (ListOffsets(earliest) already follows
the oldest object left). A fetch below the log start is answered from the first batch
left, so a consumer reading from the beginning starts at the new log start.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sortedcontainers import SortedDict

Records = list[tuple[bytes | None, bool]]  # (key, tombstone) of each record in a batch


@dataclass(frozen=True)
class Policy:
    retention_s: float | None  # batches older than this may go (cleanup.policy delete)
    retention_bytes: int | None  # ... and older ones while a partition holds more than this
    retention_batches: int | None = None  # ... and while it holds more batches than this (what a fetch lists)


@dataclass
class Batch:
    key: str  # the object's key
    offset: int  # its base offset
    size: int
    mtime_s: float


@dataclass
class Pass:
    """What one retention pass did."""

    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    log_starts: dict[str, int] = field(default_factory=dict)  # partition prefix -> its first offset now
    held_by_groups: int = 0  # partitions where an old batch stayed because a group has not read it


def varint(data: bytes, pos: int) -> tuple[int, int]:
    """A zigzag varint (Kafka's record fields) at `pos`: (value, position after it)."""
    shift = raw = 0
    while True:
        byte = data[pos]
        pos += 1
        raw |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (raw >> 1) ^ -(raw & 1), pos
        shift += 7


def batch_records(body: bytes) -> Records | None:
    """Each record's (key, tombstone) in a v2 record batch; None when it cannot be read
    (compressed, not v2, or cut short), so that the batch is kept."""
    if len(body) < 61 or body[16] != 2:
        return None
    attributes = struct.unpack_from(">h", body, 21)[0]
    if attributes & 0x20:  # a transaction marker: no keys of its own
        return []
    if attributes & 0x07:
        return None
    count, pos, records = struct.unpack_from(">i", body, 57)[0], 61, []
    try:
        for _ in range(count):
            length, pos = varint(body, pos)
            end, at = pos + length, pos + 1  # past the record's attributes
            _, at = varint(body, at)  # timestamp delta
            _, at = varint(body, at)  # offset delta
            key_length, at = varint(body, at)
            key = None if key_length < 0 else body[at:at + key_length]
            value_length, _ = varint(body, at + max(key_length, 0))
            records.append((key, value_length < 0))
            pos = end
    except IndexError:
        return None
    return records


def expired(batches: list[Batch], policy: Policy, now_s: float) -> list[Batch]:
    """cleanup.policy=delete: the oldest batches past retention, from the front."""
    total, gone = sum(b.size for b in batches), []
    for left, batch in enumerate(batches[:-1]):
        too_old = policy.retention_s is not None and batch.mtime_s < now_s - policy.retention_s
        too_big = policy.retention_bytes is not None and total > policy.retention_bytes
        too_many = policy.retention_batches is not None and len(batches) - left > policy.retention_batches
        if not (too_old or too_big or too_many):
            break
        gone.append(batch)
        total -= batch.size
    return gone


def superseded(batches: list[Batch], read: Callable[[Batch], Records | None]) -> list[Batch]:
    """cleanup.policy=compact: batches whose every key has a later record, or whose record
    of a key is a tombstone with nothing older of that key left (a batch that cannot be
    read is kept, and may hold anything older). Repeated until nothing more goes: a
    tombstone is the last of its key once the older records went."""
    records = [read(b) for b in batches]
    unreadable = next((i for i, r in enumerate(records) if r is None), len(records))
    left = list(range(len(batches)))
    while True:
        first: dict[bytes | None, int] = {}
        last: dict[bytes | None, int] = {}
        for i in left:
            for key, _ in records[i] or ():
                first.setdefault(key, i)
                last[key] = i
        going = {i for i in left[:-1] if (held := records[i]) is not None and all(
            key is not None and (last[key] > i or (tombstone and first[key] == i and unreadable > i))
            for key, tombstone in dict(held).items())}  # each key's last record in the batch
        if not going:
            return [b for i, b in enumerate(batches) if i not in left]
        left = [i for i in left if i not in going]


def group_floors(index: SortedDict, cluster: str, read_json: Callable[[str], dict]) -> dict[tuple[str, int], int]:
    """(topic, partition) -> the lowest offset any consumer group committed on it."""
    prefix = f"clusters/{cluster}/groups/consumers/"
    floors: dict[tuple[str, int], int] = {}
    for key in keys_under(index, prefix):
        parts = key[len(prefix):].split("/")  # G / offsets / T / partitions / P.json
        if len(parts) != 5 or parts[1] != "offsets" or parts[3] != "partitions":
            continue
        offset = int(read_json(key).get("offset", 0))
        where = (parts[2], int(parts[4].removesuffix(".json")))
        floors[where] = min(floors.get(where, offset), offset)
    return floors


def keys_under(index: SortedDict, prefix: str) -> Iterator[str]:
    for key in index.irange(minimum=prefix):
        if not key.startswith(prefix):
            return
        yield key


def partition_batches(index: SortedDict, prefix: str) -> list[Batch]:
    """A partition's batches, oldest offset first (their names are zero-padded offsets)."""
    return [Batch(key, int(key[len(prefix):].removesuffix(".batch")), index[key].size, index[key].mtime_ns / 1e9)
            for key in keys_under(index, prefix) if key.endswith(".batch")]


def clusters(index: SortedDict) -> list[str]:
    return [key.split("/")[1] for key in keys_under(index, "clusters/") if key.count("/") == 2
            and key.endswith("/meta.json")]


def plan(index: SortedDict, policy: Policy, now_s: float, read_json: Callable[[str], dict],
         read_records: Callable[[Batch], Records | None]) -> Pass:
    """Which batches a retention pass deletes, and each partition's first offset after it."""
    result = Pass()
    for cluster in clusters(index):
        floors = group_floors(index, cluster, read_json)
        for name, topic in read_json(f"clusters/{cluster}/meta.json").get("topics", {}).items():
            configs = {c["name"]: c.get("value") for c in topic["topic"].get("configs") or []}
            cleanup = (configs.get("cleanup.policy") or "delete").split(",")
            for partition in range(topic["topic"]["num_partitions"]):
                prefix = f"clusters/{cluster}/topics/{name}/partitions/{partition:0>10}/"
                batches = partition_batches(index, prefix + "records/")
                gone = {b.key for b in expired(batches, policy, now_s)} if "delete" in cleanup else set()
                gone |= {b.key for b in superseded(batches, read_records)} if "compact" in cleanup else set()
                # Never what a group has not read: a batch ends where the next one starts.
                floor = floors.get((name, partition))
                held = {b.key for b, after in zip(batches, batches[1:], strict=False)
                        if b.key in gone and floor is not None and after.offset > floor}
                result.held_by_groups += bool(held)
                if gone := gone - held:
                    result.deleted += sorted(gone)
                    result.freed_bytes += sum(b.size for b in batches if b.key in gone)
                    result.log_starts[prefix] = next(b.offset for b in batches if b.key not in gone)
    return result


def moved_watermark(raw: bytes, log_start: int) -> bytes | None:
    """Tansu's watermark.json with `low` moved to the partition's new first offset; None
    when it already says so."""
    watermark = json.loads(raw)
    if watermark.get("low") == log_start:
        return None
    watermark["low"] = log_start
    return json.dumps(watermark, separators=(",", ":")).encode()
