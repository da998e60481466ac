"""The feedback stream (faust): the wiring of the join (`feedback/join.py`) to Kafka.

Trajectories and feedback are both keyed by completion_id on co-partitioned topics,
so one agent sees everything about a completion, and one table (changelogged to
Kafka, so it survives a restart) holds its state. The join decides; this module reads
the topics, hands it each event with the time, and sends and counts what it returns.

A faust table may only change inside the agent that owns the key's partition, so the
sweep timer only finds windows that are due and sends their keys to WINDOW_CLOSE
(co-partitioned); the agent closes them.
"""

from __future__ import annotations

import time
from typing import Any

import faust
from prometheus_client import Counter

from feedback.join import Emitted, FeedbackJoin, join_key
from feedback.rewards import Rewarder
from liverl.contracts import Topics
from liverl.kafka import encode
from liverl.observability import setup_logging
from liverl.settings import get_settings

EVENTS = Counter("liverl_feedback_events_total", "Events seen by the join", ["topic", "outcome"])
SAMPLES = Counter("liverl_feedback_samples_total", "Samples emitted", ["source"])
logger = setup_logging("feedback")

settings = get_settings()

app = faust.App(
    "liverl-feedback",
    broker=f"kafka://{settings.bootstrap}",
    store="memory://",
    topic_partitions=settings.broker.partitions,
    web_host=settings.host,
    web_port=settings.ports.feedback,
    producer_acks=-1,
    datadir=str(settings.data_dir / "faust"),
    consumer_auto_offset_reset="earliest",
)
raw: dict[str, Any] = {"key_serializer": "raw", "value_serializer": "raw"}
incoming = app.topic(Topics.TRAJECTORIES, Topics.FEEDBACK, Topics.WINDOW_CLOSE, **raw)
window_close = app.topic(Topics.WINDOW_CLOSE, **raw)
samples_topic = app.topic(Topics.SAMPLES, **raw)
dead_letters = app.topic(Topics.DEAD_LETTER, **raw)
# Keyed by join_key(tenant, completion_id), JSON state; partitioned like the incoming
# topics (the Kafka key stays the completion_id).
completions = app.Table("completions", default=None)
feedback_join = FeedbackJoin(
    completions, Rewarder.from_file(settings.feedback.reward_config),
    window_s=settings.feedback.reward_window_s,
    max_feedback=settings.feedback.max_feedback_per_completion,
)


async def send(out: Emitted) -> None:
    for sample in out.samples:
        await samples_topic.send(key=sample.trajectory.completion_id.encode(), value=encode(sample))
        SAMPLES.labels(sample.reward_source).inc()
    for letter in out.dead_letters:
        # Keyed by the digest its id is made of, so the same refusal lands on one partition.
        await dead_letters.send(key=letter.event_id.removeprefix("dlq-").encode(), value=encode(letter))
    for topic, outcome in out.counts:
        EVENTS.labels(topic, outcome).inc()


@app.agent(incoming)
async def join(stream):
    async for event in stream.events():
        topic, raw = event.message.topic, event.value
        try:
            if topic == Topics.WINDOW_CLOSE:
                out = feedback_join.close_window(join_key(raw.decode(), event.key.decode()), time.time())
            else:
                out = feedback_join.arrived(topic, raw, time.time())
            await send(out)
        except Exception as error:  # one poisoned event must not stop the join
            logger.exception("join failed")
            refused = Emitted()
            refused.refuse(topic, f"processing failed: {error!r}", raw)
            await send(refused)


@app.timer(interval=settings.feedback.sweep_interval_s)
async def sweep() -> None:
    for key in feedback_join.windows_due(time.time()):
        # Keyed by the completion id, like the incoming topics, so the close reaches
        # the agent that owns this table key; the tenant rides in the value.
        tenant, completion_id = key.split(":", 1)
        await window_close.send(key=completion_id.encode(), value=tenant.encode())


if __name__ == "__main__":
    app.main()
