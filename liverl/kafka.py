"""Kafka plumbing shared by the producers and consumers (aiokafka and kafka-python)."""

from __future__ import annotations

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
            for name in Topics.ALL
            if name not in existing
        ]
        if wanted:
            try:
                await admin.create_topics(wanted)
            except TopicAlreadyExistsError:
                pass
    finally:
        await admin.close()
