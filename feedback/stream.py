"""The feedback stream (faust): the wiring of the join (`feedback/join.py`) to Kafka.

Trajectories and feedback are both keyed by completion_id on co-partitioned topics,
so one agent sees everything about a completion, and one table (changelogged to
Kafka, so it survives a restart) holds its state. The join decides; this module reads
the topics in batches (`take_events`), hands the join each event with the time, and
sends and counts what it returns. Windows close by how far the worker has read
(`StreamTime`), not by the clock.

Per batch, each completion whose state changed is written to the table's changelog
once, on the partition its events came from (the state records it), so the worker
that owns the partition recovers it. The table's store holds the typed states; on
recovery each entry is typed once, and the join then rebuilds its index of windows by
due time, so a restarted worker closes every window at its original deadline. The
timer measures the stream's time and closes the windows due by it; each batch closes
those due by the last measurement.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import math
import time
from collections.abc import Mapping
from typing import Any, cast

import faust
from confluent_kafka import Producer
from prometheus_client import Counter

from feedback.faust_commits import Transport, TruthfulCommitConsumer
from feedback.join import CompletionState, Emitted, FeedbackJoin
from feedback.rewards import Rewarder
from feedback.stream_time import StreamTime
from liverl.contracts import Topics
from liverl.kafka import encode, first_offset_from, group_positions
from liverl.observability import setup_logging
from liverl.settings import get_settings

EVENTS = Counter("liverl_feedback_events_total", "Events seen by the join", ["topic", "outcome"])
SAMPLES = Counter("liverl_feedback_samples_total", "Samples emitted", ["source"])
UNJOINED_OVERFLOW = Counter("liverl_feedback_unjoined_overflow_total", "Feedback dead-lettered because its "
                            "tenant had max_unjoined_per_tenant events waiting for trajectories", ["tenant"])
logger = setup_logging("feedback")  # the join logs through it too (feedback.join)
# The table holds millions of small objects that live for a window: with Python's default
# thresholds the collector rescans them so often that it took a fifth of the worker's CPU.
gc.set_threshold(100_000, 50, 100)

settings = get_settings()
SESSION_TIMEOUT_S = 10.0  # with a heartbeat every 2 s: a worker is dropped after 5 missed in a row


class App(faust.App):
    def _new_transport(self) -> Any:
        return Transport(self.conf.broker_consumer, self)


app = App(
    "liverl-feedback",
    broker=f"kafka://{settings.bootstrap}",
    store="memory://",
    topic_partitions=settings.broker.partitions,
    web_host=settings.host,
    web_port=settings.ports.feedback,
    producer_acks=-1,
    datadir=str(settings.data_dir / "faust"),
    consumer_auto_offset_reset="earliest",
    stream_buffer_maxsize=2 * settings.feedback.batch_events,  # the next batch fills while one is processed
    # A worker killed (or stopped without leaving the group) stays a member until the broker has
    # not heard from it for the session timeout, and its successor gets no partitions before
    # then: with faust's 60 s the windows of a restarted worker stayed shut for about two minutes.
    broker_session_timeout=SESSION_TIMEOUT_S,
    broker_heartbeat_interval=SESSION_TIMEOUT_S / 5,
)
raw: dict[str, Any] = {"key_serializer": "raw", "value_serializer": "raw"}
INCOMING = (Topics.TRAJECTORIES, Topics.FEEDBACK)
incoming = app.topic(*INCOMING, **raw)
# Keyed by join_key(tenant, completion_id); partitioned like the incoming topics (the
# Kafka key stays the completion_id).
completions = cast(faust.Table, app.Table("completions", default=None))
feedback_join = FeedbackJoin(
    completions.data, Rewarder.from_file(settings.feedback.reward_config),
    window_s=settings.feedback.reward_window_s,
    max_feedback=settings.feedback.max_feedback_per_completion,
    max_unjoined=settings.feedback.max_unjoined_per_tenant,
)


recovery: dict[str, float | None] = {"at": None}  # when the table was last recovered (at each rebalance)


@completions.on_recover
async def recovered() -> None:
    """Each recovered entry is its state's JSON, which faust's json codec decoded: typed
    once here, before the streams resume. The states of partitions another worker now owns
    go (faust's memory store drops only the keys it recovered itself, not those the join
    wrote): their windows are the new owner's to close. Then the join's indexes are rebuilt."""
    store, owned = completions.data, {tp.partition for tp in read_partitions()}
    for key, value in list(store.items()):
        state = value if isinstance(value, CompletionState) else CompletionState.model_validate(value)
        if state.partition in owned:
            store[key] = state
        else:
            del store[key]
    feedback_join.reindex()
    recovery["at"] = time.time()
    logger.info("table recovered: %d completions, the next window due %s", len(store),
                min(feedback_join.due, default=None))


@app.page("/table")
async def table_state(web: Any, _request: Any) -> Any:
    """The table as this worker holds it: when it was recovered (None: not yet, its windows not
    reindexed), how many completions it holds, when the next window falls due; and how far it
    has read each partition (the next offset to process, the partition's end, the time of the
    last event processed), and the stream's time the windows close by (None: not known yet)."""
    return web.json({"recovered_at": recovery["at"], "completions": len(completions.data),
                     "next_due": feedback_join.due[0][0] if feedback_join.due else None,
                     "stream_time": measured["at"] if math.isfinite(measured["at"]) else None,
                     "partitions": {f"{tp.topic}:{tp.partition}": {
                         "next": stream_time.read.get(tp, (None, None))[0], "end": measured["ends"].get(tp),
                         "last_event_at": stream_time.read.get(tp, (None, None))[1],
                         "fetching": fetching(tp), "commits": commits(tp)} for tp in read_partitions()}})


def commits(tp: Any) -> dict:
    """faust's commit records of the partition: the offset it last committed, the offsets acked
    since (how many, the lowest) and the lowest of those delivered and not acked."""
    consumer = cast(TruthfulCommitConsumer, app.consumer)
    acked = consumer._acked.get(tp) or []
    unacked = [m.offset for m in consumer._unacked_messages if m.tp == tp]
    return {"committed": consumer._committed_offset.get(tp), "acked": len(acked),
            "lowest_acked": min(acked, default=None), "lowest_unacked": min(unacked, default=None)}


def fetching(tp: Any) -> str:
    """Whether faust hands this partition's records to the agent: active, paused (during a
    recovery), or held while the agent's buffer for it is full."""
    consumer = cast(TruthfulCommitConsumer, app.consumer)
    if tp in consumer._paused_partitions:
        return "paused"
    if tp in consumer._buffered_partitions:
        return "buffer full"
    return "active" if tp in consumer._get_active_partitions() else "not fetched"


class Outbox:
    """What the join sends, through librdkafka (C): faust's pure-Python producer took a
    third of the worker's CPU at three messages per joined event. A batch waits for its
    acknowledgements before the agent acks its events, so no offset is committed ahead
    of what it produced."""

    def __init__(self, bootstrap: str):
        self.producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "partitioner": "murmur2_random",
                                  "linger.ms": 5, "message.max.bytes": 4 * 1024 * 1024,
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

    async def flush(self) -> None:
        while self.producer.flush(0):
            await asyncio.sleep(0.002)
        if self.failed:  # the worker stops uncommitted: its events come again after a restart
            raise RuntimeError(f"{len(self.failed)} messages not acknowledged, first: {self.failed[0]}")


outbox = Outbox(settings.bootstrap)


async def send(out: Emitted) -> None:
    """Samples and dead letters, then each changed state into the table's changelog (on
    its own partition; a deleted state as a tombstone), all acknowledged."""
    for sample in out.samples:
        outbox.produce(Topics.SAMPLES, sample.trajectory.completion_id.encode(), encode(sample))
        SAMPLES.labels(sample.reward_source).inc()
    for letter in out.dead_letters:
        # Keyed by the digest its id is made of, so the same refusal lands on one partition.
        outbox.produce(Topics.DEAD_LETTER, letter.event_id.removeprefix("dlq-").encode(), encode(letter))
    for (topic, outcome), n in collections.Counter(out.counts).items():  # a metric's labels() once per batch
        EVENTS.labels(topic, outcome).inc(n)
    for tenant, n in collections.Counter(out.overflowed).items():
        UNJOINED_OVERFLOW.labels(tenant).inc(n)
    changelog = completions.changelog_topic.get_topic_name()
    written = set()
    for key, partition in feedback_join.take_changed().items():
        state = feedback_join.states.get(key)
        # The table's own key and value serializers, as faust reads them back on recovery.
        outbox.produce(changelog, table_key(key), None if state is None else encode(state), partition)
        written.add(partition)
    await outbox.flush()
    # Tansu 0.6 reports a partition's high watermark as its last batch's base offset + 1,
    # and faust's recovery reads a changelog up to the watermark: the rest of a batch of
    # several states would be lost at a restart. A tombstone of a key no completion has,
    # alone in the last batch of each partition written, puts the watermark past them all.
    for partition in written:
        outbox.produce(changelog, table_key(WATERMARK_KEY), None, partition)
    await outbox.flush()


WATERMARK_KEY = "watermark"  # no completion's: theirs are tenant:completion_id (join_key), with a colon


def table_key(key: str) -> bytes:
    return completions.changelog_topic.prepare_key(key, completions.key_serializer)[0]


stream_time: StreamTime[Any] = StreamTime()


def read_partitions() -> list[Any]:
    return [tp for tp in app.consumer.assignment() if tp.topic in INCOMING]


# The stream's time as the timer last measured it, and the ends it was measured against.
measured: dict[str, Any] = {"at": -math.inf, "ends": {}}


async def measure_stream_time() -> None:
    """Against each partition's end asked of the broker now: the end faust keeps comes with
    fetched data, and a partition not fetched lately (seen after restarts: faust went on
    with one partition of four) would look read to its end, its windows closed by the clock.
    -inf until the place of every partition this worker reads is known, and while it reads
    none (between a rebalance's revocation and assignment)."""
    measured["at"] = -math.inf
    if not (partitions := read_partitions()):
        return
    generation = app.consumer_generation_id
    ends = await app.consumer.highwaters(*partitions)
    if unplaced := stream_time.unplaced(ends):  # read from the committed offsets
        committed = await group_positions(settings, app.conf.id, INCOMING)
        for tp in unplaced:
            stream_time.starts_at(tp, committed.get(f"{tp.topic}:{tp.partition}", (0, 0))[1])
    if app.consumer_generation_id == generation:  # else a rebalance came in between: the next tick
        measured["ends"], measured["at"] = ends, stream_time.at(time.time(), ends)
        await unstall(ends)
        await pass_holes()


waiting_since: dict[Any, tuple[int, float]] = {}  # partition -> (its next offset, since when it has waited there)


async def unstall(ends: Mapping[Any, int | None]) -> None:
    """Seek a partition back to its place when it is behind its end and its next event has not
    come for `feedback.fetch_stall_s` although faust counts it fetched: after some rebalances
    of two workers, faust handed one partition nothing more (feedback waiting there, the
    stream's time held back, no window closing) until the worker restarted. A seek re-reads
    what may be in flight; the join drops what it has seen."""
    now = time.monotonic()
    for tp, end in ends.items():
        next_offset = stream_time.read.get(tp, (None, None))[0]
        if next_offset is None or end is None or next_offset >= end or fetching(tp) != "active":
            waiting_since.pop(tp, None)
        elif waiting_since.get(tp, (None, 0.0))[0] != next_offset:
            waiting_since[tp] = (next_offset, now)
        elif now - waiting_since[tp][1] >= settings.feedback.fetch_stall_s:
            logger.warning("%s:%s behind its end (%s) at %s for %.0f s: sought there again",
                           tp.topic, tp.partition, end, next_offset, now - waiting_since[tp][1])
            await app.consumer.seek_wait({tp: next_offset})
            waiting_since[tp] = (next_offset, now)


held_since: dict[Any, tuple[int, float]] = {}  # partition -> (the offset its commit is held at, since when)


async def pass_holes() -> None:
    """A commit held at an offset the worker never got while it acks past it, asked of the
    broker once the hold has lasted `feedback.fetch_stall_s`. No record there: a hole in the
    log, counted done. A broker killed after numbering a batch and before storing it (it never
    acknowledged it) leaves one, and faust's commit waited there for ever: in the broker-kill
    test, 31 offsets of one partition, the stream's backlog never drained, across restarts.
    A record there: skipped by faust, read again (the join drops what it has seen)."""
    consumer = cast(TruthfulCommitConsumer, app.consumer)
    now = time.monotonic()
    for tp in read_partitions():
        held = consumer.held_at(tp)
        if held is None:
            held_since.pop(tp, None)
        elif held_since.get(tp, (None, 0.0))[0] != held:
            held_since[tp] = (held, now)
        elif now - held_since[tp][1] >= settings.feedback.fetch_stall_s:
            first = await first_offset_from(settings, tp.topic, tp.partition, held)
            if first is not None and first > held:
                logger.warning("%s:%s has no records at %s-%s (a hole in the log): counted done",
                               tp.topic, tp.partition, held, first - 1)
                consumer.count_done(tp, held, first)
            elif first == held:
                logger.warning("%s:%s held at %s, never handed over: sought there again", tp.topic, tp.partition, held)
                await app.consumer.seek_wait({tp: held})
            held_since[tp] = (held, now)


@app.on_partitions_revoked.connect  # type: ignore[arg-type]  # mode's hint rejects faust's documented receiver
async def forget_revoked(_app: Any, revoked: set[Any], **_: Any) -> None:
    stream_time.forget(revoked)
    for tp in revoked:
        waiting_since.pop(tp, None)
        held_since.pop(tp, None)
    measured["at"] = -math.inf


@app.agent(incoming)
async def join(stream):
    async for events in stream.take_events(settings.feedback.batch_events, within=settings.feedback.batch_s):
        batch = [(e.message.topic, e.value, e.message.partition) for e in events]
        for e in events:
            stream_time.processed(e.message.tp, e.message.offset, e.message.timestamp)
        await send(feedback_join.process(batch, time.time(), measured["at"]))


@app.timer(interval=settings.feedback.sweep_interval_s)
async def close_due_windows() -> None:
    """Windows fall due while no events arrive too; each batch closes those due by the stream's
    time measured here last."""
    try:
        await measure_stream_time()
    except Exception as error:  # the broker away: windows wait for the next tick
        logger.warning("the stream's time not measured: %r", error)
        return
    await send(feedback_join.close_due(min(time.time(), measured["at"])))


if __name__ == "__main__":
    app.main()
