"""Kafka plumbing shared by the producers and consumers (aiokafka and kafka-python)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from pydantic import BaseModel

from liverl.contracts import Topics
from liverl.settings import KafkaBroker, Settings

# kafka-python consumer groups only join Tansu with this protocol version pinned.
KAFKA_PYTHON_API_VERSION = (2, 8, 0)


def encode(event: BaseModel) -> bytes:
    return event.model_dump_json().encode()


def murmur2_many(keys: Sequence[bytes]) -> np.ndarray:
    """Kafka's murmur2 (the Java client's and aiokafka's default partitioner hash) of many
    keys at once: numpy over keys of equal length, instead of a Python loop per byte."""
    m, out = np.uint32(0x5BD1E995), np.empty(len(keys), np.uint32)
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        by_length[len(key)].append(i)
    for length, rows in by_length.items():
        data = np.frombuffer(b"".join(keys[i] for i in rows), np.uint8).reshape(len(rows), length)
        h = np.full(len(rows), 0x9747B28C ^ length, np.uint32)
        words = np.ascontiguousarray(data[:, : length // 4 * 4]).view("<u4")
        for k in words.T.copy():  # uint32 arithmetic wraps, as Java's int does
            k *= m
            k ^= k >> np.uint32(24)
            k *= m
            h = (h * m) ^ k
        tail = data[:, length // 4 * 4:].astype(np.uint32)
        for byte in reversed(range(tail.shape[1])):
            h ^= tail[:, byte] << np.uint32(8 * byte)
        if tail.shape[1]:
            h *= m
        h ^= h >> np.uint32(13)
        h *= m
        h ^= h >> np.uint32(15)
        out[rows] = h
    return out


async def send_many(producer: AIOKafkaProducer,
                    messages: Sequence[tuple[str, bytes, bytes]]) -> list[asyncio.Future]:
    """Send (topic, key, value) messages; returns each one's delivery future.

    Keys go to the partitions the default partitioner would pick (murmur2), so
    co-partitioning with other producers holds, but hashed for the whole list at once:
    aiokafka's per-key pure-Python murmur2 was a sixth of the ingest API's CPU time.
    (`send_batch` would save more, but aiokafka lets one batch per partition wait at a
    time and times concurrent callers out.)
    """
    hashes = (murmur2_many([key for _, key, _ in messages]) & np.uint32(0x7FFFFFFF)).tolist()
    partitions = {topic: sorted(await producer.partitions_for(topic)) for topic in {t for t, _, _ in messages}}
    return [await producer.send(topic, value, key=key, partition=partitions[topic][h % len(partitions[topic])])
            for (topic, key, value), h in zip(messages, hashes)]


def make_producer(settings: Settings, **overrides: object) -> AIOKafkaProducer:
    """An idempotent-enough producer: acks=all, so an ack means the broker has it."""
    options: dict[str, object] = dict(
        bootstrap_servers=settings.bootstrap,
        acks="all",
        linger_ms=5,
        max_request_size=4 * 1024 * 1024,
        compression_type=None,
    )
    options.update(overrides)
    return AIOKafkaProducer(**options)


async def ensure_topics(settings: Settings) -> None:
    """Create liverl's topics (co-partitioned: the join needs it)."""
    broker = settings.broker
    replication = broker.replication_factor if isinstance(broker, KafkaBroker) else 1
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(name, num_partitions=broker.partitions, replication_factor=replication)
            for name in Topics.ALL + Topics.INTERNAL
            if name not in existing
        ]
        if wanted:
            try:
                await admin.create_topics(wanted)
            except TopicAlreadyExistsError:
                pass
    finally:
        await admin.close()


async def group_lag(settings: Settings, group: str, topics: tuple[str, ...]) -> int:
    """Messages on `topics` not yet committed by consumer group `group`.

    Uses a consumer's OffsetFetch (`committed`) rather than the admin API, which Tansu
    0.6 does not answer, and reads the last batch of each partition for its true end:
    Tansu reports a high watermark of the last batch's base offset + 1.
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, group_id=group,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer.topics()  # fetches the metadata partitions_for_topic reads
        partitions = [TopicPartition(t, p) for t in topics
                      for p in sorted(consumer.partitions_for_topic(t) or ())]
        if not partitions:
            return 0
        watermarks = await consumer.end_offsets(partitions)
        consumer.assign(partitions)
        ends = {}
        for tp, watermark in watermarks.items():
            ends[tp] = watermark
            if watermark > 0:
                consumer.seek(tp, watermark - 1)
                batch = await consumer.getmany(tp, timeout_ms=2000)
                ends[tp] = max([watermark] + [m.offset + 1 for m in batch.get(tp, [])])
        lag = 0
        for tp, end in ends.items():
            lag += max(end - (await consumer.committed(tp) or 0), 0)
        return lag
    finally:
        await consumer.stop()


def check_reachable(settings: Settings) -> None:
    """Fail fast: kafka-python would wait for metadata from a missing broker forever."""
    host, _, port = settings.bootstrap.split(",")[0].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as error:
        raise ConnectionError(f"the broker at {settings.bootstrap} is not reachable ({error}); "
                              "is the stack up (`liverl status`)?") from error


def read_topic(settings: Settings, topic: str, timeout_s: float = 10.0) -> list[bytes]:
    """Every message on a topic, from the beginning to its current end (no group)."""
    from kafka import KafkaConsumer, TopicPartition

    check_reachable(settings)
    consumer = KafkaConsumer(bootstrap_servers=settings.bootstrap, enable_auto_commit=False,
                             api_version=KAFKA_PYTHON_API_VERSION)
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        ends = consumer.end_offsets(partitions)
        values: list[bytes] = []
        deadline = time.time() + timeout_s
        while any(consumer.position(tp) < end for tp, end in ends.items()) and time.time() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                values.extend(r.value for r in records)
        return values
    finally:
        consumer.close()


def partition_key(payload: bytes) -> bytes | None:
    """The completion_id a payload belongs to, wherever the contract puts it."""
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    key = data.get("completion_id") or (data.get("body") or {}).get("completion_id")
    return key.encode() if isinstance(key, str) else None


def produce_sync(settings: Settings, topic: str, payload: bytes) -> None:
    from kafka import KafkaProducer

    check_reachable(settings)
    producer = KafkaProducer(bootstrap_servers=settings.bootstrap, acks="all",
                             api_version=KAFKA_PYTHON_API_VERSION)
    try:
        producer.send(topic, payload, key=partition_key(payload)).get(timeout=30)
    finally:
        producer.close()
