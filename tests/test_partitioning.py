"""A feedback event must land on the partition of its trajectory, or the join never sees
them together. The gateway produces trajectories with aiokafka's default partitioner;
the ingest API produces feedback with librdkafka (`liverl.kafka.BatchProducer`). This
checks on the real broker that both put every key on the same partition."""

import asyncio
import random

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import DefaultPartitioner

from liverl.kafka import BatchProducer

PARTITIONS = 5


async def produce_and_read_back(settings, topic: str, keys: list[bytes]) -> dict[bytes, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])
    finally:
        await admin.close()
    producer = BatchProducer(settings, delivery_timeout_s=30)
    try:
        assert await producer.send_many([(topic, key, b"{}") for key in keys]) == [None] * len(keys)
    finally:
        producer.close()
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=settings.bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    placed: dict[bytes, int] = {}
    try:
        while len(placed) < len(keys):
            for records in (await consumer.getmany(timeout_ms=2000)).values():
                placed.update((r.key, r.partition) for r in records)
    finally:
        await consumer.stop()
    return placed


def test_ingest_producer_places_keys_where_the_default_partitioner_does(stack, settings):
    rng = random.Random(0)
    keys = list({rng.randbytes(rng.randrange(1, 70)) for _ in range(800)})
    keys += [f"cmpl-{rng.getrandbits(128):032x}".encode() for _ in range(200)]
    placed = asyncio.run(asyncio.wait_for(produce_and_read_back(settings, "liverl-test-partitioning", keys), 60))
    aiokafka_default = DefaultPartitioner()
    every = list(range(PARTITIONS))
    assert {key: aiokafka_default(key, every, every) for key in keys} == placed
