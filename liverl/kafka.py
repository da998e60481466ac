"""Kafka plumbing shared by the producers and consumers (aiokafka, confluent-kafka, kafka-python)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import time
from collections.abc import Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from confluent_kafka import KafkaException, Producer
from pydantic import BaseModel

from liverl.backlog import Backlog
from liverl.contracts import Topics
from liverl.settings import KafkaBroker, Settings

# kafka-python consumer groups only join Tansu with this protocol version pinned; written
# as kafka-python 3 keys it (it warns about (2, 8, 0) at every connect).
KAFKA_PYTHON_API_VERSION = (2, 8)


def encode(event: BaseModel) -> bytes:
    # The same bytes as model_dump_json().encode(), without its per-call option handling
    # and the str round trip: half the cost per event on the ingest path.
    return event.__pydantic_serializer__.to_json(event)


class BatchProducer:
    """The ingest API's producer: librdkafka (confluent-kafka) for asyncio callers.

    Batches of keyed messages go out together and each message's broker acknowledgement
    comes back to the awaiting coroutine. librdkafka batches, sends and partitions in C
    on its own threads, where aiokafka's per-message `send` runs in Python
    (docs/benchmarks.md, Ingest). `murmur2_random` is the Java client's and
    aiokafka's default partitioner, so a feedback event lands on the partition of its
    trajectory (produced by the gateway with aiokafka): the join relies on it.
    """

    def __init__(self, settings: Settings, delivery_timeout_s: float):
        self._producer = Producer({
            "bootstrap.servers": settings.bootstrap, "acks": "all", "partitioner": "murmur2_random",
            # Small batches, sent at once: an API request waits for its acks.
            "linger.ms": 2, "socket.nagle.disable": True,
            "message.timeout.ms": int(delivery_timeout_s * 1000),
            "message.max.bytes": 4 * 1024 * 1024,
            "logger": logging.getLogger("librdkafka"),  # structured lines, not its own format
        })
        self._awaiting = 0  # messages produced whose delivery report has not been served
        self._poller: asyncio.Task | None = None

    async def _serve_delivery_reports(self) -> None:
        """Serves delivery reports on the event loop's own thread while any are due: no
        poller thread, no lock, no cross-thread wake-up (a poller thread measured the
        same in the ingest benchmark, with more to get wrong)."""
        while self._awaiting:
            if not self._producer.poll(0):
                await asyncio.sleep(0.001)

    async def send_many(self, messages: Sequence[tuple[str, bytes, bytes]]) -> list[str | None]:
        """Produce (topic, key, value) messages; per message, None once the broker
        acknowledged it, or why it did not."""
        done = asyncio.get_running_loop().create_future()
        results: list[str | None] = [None] * len(messages)
        pending = len(messages)

        def delivered(index: int, error: object, _message: object = None) -> None:
            nonlocal pending
            if error is not None:
                results[index] = str(error)
            pending -= 1
            self._awaiting -= 1
            if pending == 0 and not done.done():  # the request may have been cancelled
                done.set_result(None)

        self._awaiting += len(messages)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._serve_delivery_reports())
        for index, (topic, key, value) in enumerate(messages):
            while True:
                try:
                    self._producer.produce(topic, value, key, on_delivery=functools.partial(delivered, index))
                    break
                except BufferError:  # librdkafka's local queue is full: let it drain
                    await asyncio.sleep(0.005)
                except KafkaException as error:  # refused before sending (e.g. unknown topic)
                    delivered(index, error.args[0])
                    break
        if messages:
            await done
        return results

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.flush(timeout_s)


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
    """Messages on `topics` not yet committed by consumer group `group`."""
    return sum(max(end - committed, 0) for end, committed in (await group_positions(settings, group, topics)).values())


async def group_positions(settings: Settings, group: str, topics: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """'topic:partition' -> (its end, what consumer group `group` committed there).

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
            return {}
        watermarks = await consumer.end_offsets(partitions)
        consumer.assign(partitions)
        positions = {}
        for tp, watermark in watermarks.items():
            end = watermark
            if watermark > 0:
                consumer.seek(tp, watermark - 1)
                batch = await consumer.getmany(tp, timeout_ms=2000)
                end = max([watermark] + [m.offset + 1 for m in batch.get(tp, [])])
            positions[f"{tp.topic}:{tp.partition}"] = (end, await consumer.committed(tp) or 0)
        return positions
    finally:
        await consumer.stop()


async def group_backlog(settings: Settings, group: str, topics: tuple[str, ...]) -> Backlog:
    """Consumer group `group`'s backlog on `topics`: its lag, and the age of the message at
    each partition's committed offset (the oldest it has not processed) by its timestamp."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    positions = await group_positions(settings, group, topics)
    behind = {key: committed for key, (end, committed) in positions.items() if end > committed}
    if not behind:
        return Backlog(messages=0)
    messages = sum(positions[key][0] - committed for key, committed in behind.items())
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap, enable_auto_commit=False)  # reads, joins no group
    await consumer.start()
    try:
        partitions = {TopicPartition(key.rsplit(":", 1)[0], int(key.rsplit(":", 1)[1])): at
                      for key, at in behind.items()}
        consumer.assign(list(partitions))
        oldest_ms = []
        for tp, at in partitions.items():
            consumer.seek(tp, at)
            batch = await consumer.getmany(tp, timeout_ms=2000, max_records=1)
            oldest_ms += [m.timestamp for m in batch.get(tp, [])]
    finally:
        await consumer.stop()
    return Backlog(messages=messages, oldest_s=max(time.time() - min(oldest_ms) / 1000, 0.0) if oldest_ms else None,
                   waiting=behind)


def check_reachable(settings: Settings) -> None:
    """Fail fast: kafka-python would wait for metadata from a missing broker forever."""
    host, _, port = settings.bootstrap.split(",")[0].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as error:
        raise ConnectionError(f"the broker at {settings.bootstrap} is not reachable ({error}); "
                              "is the stack up (`liverl status`)?") from error


def read_topic(settings: Settings, topic: str, timeout_s: float = 10.0) -> list[bytes]:
    """Every message on a topic, from the beginning to its current end (no group): past the
    end offsets the broker answers, until a poll finds nothing more, since Tansu answers a
    partition's last batch's base offset + 1 as its end."""
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
        while time.time() < deadline:
            polled = consumer.poll(timeout_ms=1000)
            values.extend(r.value for records in polled.values() for r in records)
            if not polled and all(consumer.position(tp) >= end for tp, end in ends.items()):
                break
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
