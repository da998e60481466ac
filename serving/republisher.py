"""Re-publishing what the broker did not take: the outbox's records, oldest first, through
a producer of their own, each deleted from the outbox only once its delivery report says
the broker has it.

At least once: a record whose report was lost (the gateway killed between the broker's
ack and the delete) is sent again, and downstream drops the repeat by its event id (the
feedback join keeps each completion's event ids, the sink each table's). Runs as a task on
the gateway's loop: a produce is a hand-over to librdkafka's queue, so serving never waits
on it. A record re-published arrives after records made since, which the join allows
(feedback may come before its trajectory).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from prometheus_client import Counter

from liverl.observability import log, setup_logging
from serving.outbox import Kept, Outbox

REPUBLISHED = Counter("liverl_gateway_outbox_republished_total", "Records re-published from the outbox (delivered)")
logger = setup_logging("gateway")
BATCH_BYTES = 4 * 1024 * 1024  # what one round reads from the outbox into memory
IDLE_S = 1.0  # how often an empty outbox is looked at again
RETRY_S = 5.0  # the pause after a round the broker did not take whole (each try waits out the delivery timeout)
REPORTS_EVERY_S = 0.05


class Republisher:
    """The outbox's records back to the broker, round after round, while the gateway runs."""

    def __init__(self, outbox: Outbox, producer: Producer):
        self.outbox, self.producer = outbox, producer
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        """Records still in flight stay in the outbox (the next start sends them again)."""
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.producer.purge()
        self.producer.flush(1)  # serves the purged records' reports: none deletes anything

    async def run(self) -> None:
        while True:
            batch = self.outbox.oldest(BATCH_BYTES)
            if not batch:
                await asyncio.sleep(IDLE_S)
                continue
            taken = await self.publish(batch)
            if taken < len(batch):
                log(logger, "re-publishing: the broker did not take them; retrying",
                    records=len(batch) - taken, held=self.outbox.records, retry_s=RETRY_S)
                await asyncio.sleep(RETRY_S)

    async def publish(self, batch: list[Kept]) -> int:
        """How many of `batch` the broker took, each deleted from the outbox as its report comes."""
        reports: list[bool] = []

        def reported(record: Kept, error: KafkaError | None, _message: Message | None) -> None:
            reports.append(error is None)
            if error is None:
                self.outbox.remove(record)
                REPUBLISHED.inc()
            elif error.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                self.outbox.discard(record, str(error))

        for record in batch:
            try:
                self.producer.produce(record.topic, record.value, record.key,
                                      on_delivery=functools.partial(reported, record))
            except BufferError:
                reports.append(False)
            except KafkaException as error:
                reported(record, error.args[0], None)
        while len(reports) < len(batch):  # the delivery timeout bounds the wait
            self.producer.poll(0)
            await asyncio.sleep(REPORTS_EVERY_S)
        return sum(reports)
