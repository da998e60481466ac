"""The feedback stream: the join (`feedback/join.py`) wired to Kafka through librdkafka.

    python -m feedback.stream [--port PORT]     # what `liverl up` starts, once per worker

Trajectories and feedback are both keyed by completion_id on co-partitioned topics. The
workers of one consumer group split them with the range assignor, which gives a worker the
same partition numbers of both topics, so one worker sees everything about a completion.
Its states are a dict in memory and a changelog topic: per batch, each completion whose
state changed is written there once, on the partition its events came from. A worker given
a partition first restores that partition's states from the changelog (as a Kafka Streams
state store is restored), then the join rebuilds its index of windows by due time, so every
window closes at its original deadline whoever owns it.

A batch is up to `feedback.batch_events` messages within `feedback.batch_s`; what the join
returns (samples, dead letters, changed states) is produced and acknowledged, and only then
are the batch's offsets committed. A worker killed at any line re-reads at most what it
had not committed: events the restored states know are dropped as duplicates, and a sample
emitted again has the same event id, which the sink and the learner keep once. Windows
close by how far the worker has read (`StreamTime`), not by the clock: every
`feedback.sweep_interval_s` the worker asks the broker for each partition's end and closes
the windows due by the stream's time.

Why not faust (the stream's framework until Nov 29): its per-event machinery cost more
than the join itself. Reading the two topics and nothing else, faust did 6,299 feedback
events per CPU-second, librdkafka 759,273, and librdkafka with the join 17,625 (medians of
three runs: benchmarks/bench_stream_floor.py, docs/benchmarks.md).
"""

from __future__ import annotations

import collections
import gc
import json
import logging
import math
import threading
import time
from typing import Any, cast

import typer
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, Producer, TopicPartition
from fastapi import FastAPI
from prometheus_client import Counter

from feedback.join import CompletionState, Emitted, FeedbackJoin
from feedback.rewards import Rewarder
from feedback.stream_time import StreamTime
from liverl.contracts import Topics
from liverl.http import service_app
from liverl.kafka import encode
from liverl.observability import setup_logging
from liverl.process import serve_beside
from liverl.settings import Settings, get_settings

EVENTS = Counter("liverl_feedback_events_total", "Events seen by the join", ["topic", "outcome"])
SAMPLES = Counter("liverl_feedback_samples_total", "Samples emitted", ["source"])
UNJOINED_OVERFLOW = Counter("liverl_feedback_unjoined_overflow_total", "Feedback dead-lettered because its "
                            "tenant had max_unjoined_per_tenant events waiting for trajectories", ["tenant"])
logger = setup_logging("feedback")  # the join logs through it too (feedback.join)

GROUP = "liverl-feedback"
INCOMING = (Topics.TRAJECTORIES, Topics.FEEDBACK)
SESSION_TIMEOUT_S = 10.0  # with a heartbeat every 2 s: a worker is dropped after 5 missed in a row
# Tansu 0.6 reports a partition's high watermark as its last batch's base offset + 1, and a
# restore reads a changelog up to the watermark: the rest of a batch of several states would
# be lost. A tombstone of a key no completion has, alone in the last batch of each partition
# written, puts the watermark past them all.
WATERMARK_KEY = "watermark"  # no completion's: theirs are tenant:completion_id (join_key), with a colon
RESTORE_STALL_S = 60.0  # a restore that reads nothing for this long asks whether the broker is there

Partition = tuple[str, int]  # (topic, partition)


def place(message: Message) -> tuple[str, int, int]:
    """A consumed message's topic, partition and offset (None only in an error event)."""
    return cast(str, message.topic()), cast(int, message.partition()), cast(int, message.offset())


def changelog_key(key: str) -> bytes:
    """As faust wrote its table's keys (JSON strings), so stores it wrote restore here."""
    return json.dumps(key).encode()


class Garbage:
    """Python's cyclic collector, run by the loop. The states are millions of small objects that
    live for a window and hold no reference cycles, and the collector rescanned them at each
    pass over its older generations. So it runs only after each batch (and each tick), over
    what is young, and what survives is frozen out of its view (`gc.freeze`): a state dropped
    later is freed by its reference count as before. Cyclic garbage frozen while still in use
    (the HTTP thread's, at most) is collected by a full pass every `FULL_EVERY_S`. Draining a
    million: 13,203 joined per CPU-second with the collector's thresholds raised a
    hundredfold, 14,083 frozen after each batch (one run each)."""

    FULL_EVERY_S = 600.0

    def __init__(self) -> None:
        gc.disable()
        self.full_at = time.monotonic() + self.FULL_EVERY_S

    def settle(self) -> None:
        if time.monotonic() >= self.full_at:
            self.full_at = time.monotonic() + self.FULL_EVERY_S
            gc.unfreeze()
            gc.collect()
        else:
            gc.collect(1)
        gc.freeze()


class Outbox:
    """What the join sends, through librdkafka. A batch waits for its acknowledgements
    before its offsets are committed, so no offset is committed ahead of what it produced."""

    def __init__(self, bootstrap: str):
        self.producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "partitioner": "murmur2_random",
                                  "linger.ms": 5, "message.max.bytes": 4 * 1024 * 1024,
                                  # Only a failed delivery needs a Python call (`_delivered`).
                                  "delivery.report.only.error": True,
                                  "logger": logging.getLogger("librdkafka")})
        self.failed: list[str] = []

    def produce(self, topic: str, key: bytes, value: bytes | None, partition: int = -1) -> None:
        """Partition -1: the partitioner picks it from the key."""
        while True:
            try:
                return self.producer.produce(topic, value, key, partition, on_delivery=self._delivered)
            except BufferError:  # librdkafka's local queue is full: let it drain
                self.producer.poll(0.01)

    def _delivered(self, error: object, _message: object) -> None:
        if error is not None:
            self.failed.append(str(error))

    def flush(self) -> None:
        while self.producer.flush(1.0):
            pass
        if self.failed:  # the worker stops uncommitted: its events come again after a restart
            raise RuntimeError(f"{len(self.failed)} messages not acknowledged, first: {self.failed[0]}")


class StreamWorker:
    """One worker of the group: its consumer, its states and their changelog, its clock."""

    def __init__(self, settings: Settings):
        self.settings = settings
        config = settings.feedback
        self.states: dict[str, CompletionState] = {}
        self.join = FeedbackJoin(self.states, Rewarder.from_file(config.reward_config),
                                 window_s=config.reward_window_s, max_feedback=config.max_feedback_per_completion,
                                 max_unjoined=config.max_unjoined_per_tenant)
        self.outbox = Outbox(settings.bootstrap)
        self.garbage = Garbage()
        self.stream_time: StreamTime[Partition] = StreamTime()
        self.owned: set[int] = set()  # partition numbers whose states this worker holds
        self.recovered_at: float | None = None  # when the states were last restored (at each assignment)
        self.measured_at = -math.inf  # the stream's time as last measured
        self.ends: dict[Partition, int | None] = {}  # the partition ends it was measured against
        self.consumer = Consumer({
            "bootstrap.servers": settings.bootstrap, "group.id": GROUP,
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
            # Co-partitioning: the range assignor gives a member the same partitions of each topic.
            "partition.assignment.strategy": "range",
            # A worker killed (or stopped without leaving the group) stays a member until the broker
            # has not heard from it for the session timeout; its successor gets no partitions before.
            "session.timeout.ms": int(SESSION_TIMEOUT_S * 1000), "heartbeat.interval.ms": int(SESSION_TIMEOUT_S * 200),
            "logger": logging.getLogger("librdkafka"),
        })
        self.lock = threading.Lock()  # the page reads what the loop writes
        self.page: dict[str, Any] = {"recovered_at": None, "completions": 0, "next_due": None,
                                     "stream_time": None, "partitions": {}}

    # --- the loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.consumer.subscribe(list(INCOMING), on_assign=self.assigned, on_revoke=self.revoked,
                                on_lost=self.revoked)
        next_tick = 0.0
        try:
            while not stop.is_set():
                batch = self.consumer.consume(self.settings.feedback.batch_events, self.settings.feedback.batch_s)
                if batch:
                    self.process(batch)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self.settings.feedback.sweep_interval_s
                    self.tick()
                    self.garbage.settle()
                self.publish_page()
        finally:
            self.consumer.close()  # leaves the group: the other workers take its partitions at once

    def process(self, batch: list[Message]) -> None:
        """The batch through the join, what it returns acknowledged, then its offsets committed."""
        events, offsets = [], {}
        for message in batch:
            if error := message.error():  # partition ends are not reported (enable.partition.eof off)
                logger.warning("consuming: %s", error)
                continue
            topic, partition, offset = place(message)
            if partition not in self.owned:  # fetched before a rebalance gave it away: its new owner's
                continue
            events.append((topic, message.value() or b"", partition))
            self.stream_time.processed((topic, partition), offset, message.timestamp()[1] / 1000)
            offsets[(topic, partition)] = offset + 1
        self.send(self.join.process(events, time.time(), self.measured_at))
        if offsets:
            self.commit(offsets)
        self.garbage.settle()

    def commit(self, offsets: dict[Partition, int]) -> None:
        try:
            self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                 asynchronous=False)
        except KafkaException as error:
            # A rebalance took the partitions: their new owner reads them from the last commit,
            # and drops as duplicates the events whose states this batch changelogged.
            logger.warning("offsets %s not committed: %s", offsets, error)

    def tick(self) -> None:
        """The stream's time measured against each partition's end now, and the windows due by it
        closed (windows fall due while no events arrive too)."""
        try:
            self.measure_stream_time()
        except KafkaException as error:  # the broker away: windows wait for the next tick
            logger.warning("the stream's time not measured: %s", error)
            return
        self.send(self.join.close_due(min(time.time(), self.measured_at)))

    def measure_stream_time(self) -> None:
        """-inf until the place of every partition this worker reads is known, and while it reads none."""
        self.measured_at = -math.inf
        partitions = [(tp.topic, tp.partition) for tp in self.consumer.assignment()]
        if not partitions:
            return
        ends: dict[Partition, int | None] = {}
        for topic, partition in partitions:
            ends[(topic, partition)] = self.consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=5, cached=False)[1]
        if unplaced := self.stream_time.unplaced(ends):  # read from the committed offsets
            committed = self.consumer.committed([TopicPartition(t, p) for t, p in unplaced], timeout=10)
            for tp in committed:
                low = self.consumer.get_watermark_offsets(tp, timeout=5, cached=False)[0]
                self.stream_time.starts_at((tp.topic, tp.partition), tp.offset if tp.offset >= 0 else low)
        self.ends, self.measured_at = ends, self.stream_time.at(time.time(), ends)

    def send(self, out: Emitted) -> None:
        """Samples and dead letters, then each changed state into the changelog (on its own
        partition; a deleted state as a tombstone), all acknowledged."""
        for sample in out.samples:
            self.outbox.produce(Topics.SAMPLES, sample.trajectory.completion_id.encode(), encode(sample))
        for source, n in collections.Counter(s.reward_source for s in out.samples).items():
            SAMPLES.labels(source).inc(n)
        for letter in out.dead_letters:
            # Keyed by the digest its id is made of, so the same refusal lands on one partition.
            self.outbox.produce(Topics.DEAD_LETTER, letter.event_id.removeprefix("dlq-").encode(), encode(letter))
        for (topic, outcome), n in collections.Counter(out.counts).items():  # a metric's labels() once per batch
            EVENTS.labels(topic, outcome).inc(n)
        for tenant, n in collections.Counter(out.overflowed).items():
            UNJOINED_OVERFLOW.labels(tenant).inc(n)
        written = set()
        for key, partition in self.join.take_changed().items():
            state = self.states.get(key)
            self.outbox.produce(Topics.COMPLETIONS_CHANGELOG, changelog_key(key),
                                None if state is None else encode(state), partition)
            written.add(partition)
        self.outbox.flush()
        for partition in written:
            self.outbox.produce(Topics.COMPLETIONS_CHANGELOG, changelog_key(WATERMARK_KEY), None, partition)
        self.outbox.flush()

    # --- rebalances -------------------------------------------------------------------------

    def assigned(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The states of partitions no longer this worker's go (their windows are the new
        owner's to close); those of partitions new to it are restored from the changelog; then
        the join's indexes are rebuilt."""
        now_owned = {tp.partition for tp in partitions}
        for key in [key for key, state in self.states.items() if state.partition not in now_owned]:
            del self.states[key]
        for partition in sorted(now_owned - self.owned):
            self.restore(partition)
        self.owned = now_owned
        self.join.reindex()
        self.recovered_at = time.time()
        logger.info("assigned %s: %d completions, the next window due %s",
                    sorted(f"{tp.topic}:{tp.partition}" for tp in partitions), len(self.states),
                    min(self.join.due, default=None))

    def revoked(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Another worker reads them now (their states go at the next assignment)."""
        self.stream_time.forget((tp.topic, tp.partition) for tp in partitions)
        self.measured_at = -math.inf

    def restore(self, partition: int) -> None:
        """One changelog partition read from its start to its end: the latest entry per key."""
        reader = Consumer({"bootstrap.servers": self.settings.bootstrap, "group.id": f"{GROUP}-restore",
                           "enable.auto.commit": False, "logger": logging.getLogger("librdkafka")})
        try:
            tp = TopicPartition(Topics.COMPLETIONS_CHANGELOG, partition)
            low, end = reader.get_watermark_offsets(tp, timeout=10, cached=False)
            latest: dict[bytes, bytes | None] = {}
            if end > low:
                reader.assign([TopicPartition(tp.topic, partition, OFFSET_BEGINNING)])
                position, progressed = low, time.monotonic()
                while position < end:
                    if time.monotonic() - progressed > RESTORE_STALL_S:
                        # The broker answers (a broker away raises here, and the supervisor starts
                        # the worker again) but has no records from `position` on: offsets a
                        # broker killed mid-write numbered and never stored. Waiting would not end.
                        reader.get_watermark_offsets(tp, timeout=10, cached=False)
                        logger.warning("restoring %s:%s: no records at %s-%s (a hole in the log): restored "
                                       "up to it", tp.topic, partition, position, end - 1)
                        break
                    for message in reader.consume(10_000, 1.0):
                        if message.error():
                            continue
                        latest[message.key() or b""] = message.value()
                        position, progressed = place(message)[2] + 1, time.monotonic()
        finally:
            reader.close()
        for raw_key, value in latest.items():
            key = json.loads(raw_key)
            if value is None:
                self.states.pop(key, None)
            else:
                self.states[key] = CompletionState.model_validate_json(value)

    # --- what on-call sees ------------------------------------------------------------------

    def publish_page(self) -> None:
        """The page as of now, for the HTTP thread (which must not iterate what the loop changes)."""
        page = {"recovered_at": self.recovered_at, "completions": len(self.states),
                "next_due": self.join.due[0][0] if self.join.due else None,
                "stream_time": self.measured_at if math.isfinite(self.measured_at) else None,
                "partitions": {f"{topic}:{partition}": {
                    "next": self.stream_time.read.get((topic, partition), (None, None))[0],
                    "end": self.ends.get((topic, partition)),
                    "last_event_at": self.stream_time.read.get((topic, partition), (None, None))[1]}
                    for topic, partition in ((tp.topic, tp.partition) for tp in self.consumer.assignment())}}
        with self.lock:
            self.page = page


def create_app(worker: StreamWorker) -> FastAPI:
    app = service_app("liverl feedback stream", worker.settings)

    @app.get("/table")
    def table() -> dict:
        """The states as this worker holds them: when they were last restored (None: not yet,
        its windows not indexed), how many, when the next window falls due; how far it has read
        each partition (the next offset to process, the partition's end, the time of the last
        event processed), and the stream's time the windows close by (None: not known yet)."""
        with worker.lock:
            return worker.page

    return app


def main(port: int | None = typer.Option(None, help="The worker's HTTP port (health, /table, /metrics); "
                                         "ports.feedback unless given (a second worker needs its own).")) -> None:
    settings = get_settings()
    worker = StreamWorker(settings)
    serve_beside(create_app(worker), settings.host, port or settings.ports.feedback, worker.run)


if __name__ == "__main__":
    typer.run(main)
