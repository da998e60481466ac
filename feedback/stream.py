"""The feedback stream (faust): join feedback to trajectories, reward, emit samples.

Trajectories and feedback are both keyed by completion_id on co-partitioned topics,
so one agent sees everything about a completion, and one table (changelogged to
Kafka, so it survives a restart) holds its state, per tenant and completion (a
completion id is the tenant's own name: another tenant using the same id shares
nothing with it):

    {"trajectory": {...} | None, "feedback": [...], "event_ids": [...],
     "revision": -1, "closed": False, "first_seen": epoch seconds}

- feedback may arrive before its trajectory: it waits, up to the reward window;
- the first feedback on a known trajectory emits revision 0 of the sample; more
  feedback inside the window emits revision 1, 2, ... (the learner keeps the latest
  revision it has not trained on yet);
- when the window closes with no feedback, the tenant's default reward (if any);
- feedback after the window closed is counted late and still emits a revision;
- duplicates (same event_id) are dropped; malformed or unjoinable events go to the
  dead-letter topic with the reason.

A faust table may only change inside the agent that owns the key's partition, so the
sweep timer only finds windows that are due and sends their keys to WINDOW_CLOSE
(co-partitioned); the join closes them.
"""

from __future__ import annotations

import hashlib
import time
from datetime import datetime
from typing import Any

import faust
from prometheus_client import Counter
from pydantic import ValidationError

from feedback.rewards import Rewarder, RewardResult
from liverl.contracts import (
    DeadLetter,
    FeedbackEvent,
    RewardedSample,
    Topics,
    Trajectory,
)
from liverl.kafka import encode
from liverl.observability import setup_logging
from liverl.settings import get_settings

EVENTS = Counter("liverl_feedback_events_total", "Events seen by the join", ["topic", "outcome"])
SAMPLES = Counter("liverl_feedback_samples_total", "Samples emitted", ["source"])
logger = setup_logging("feedback")

settings = get_settings()
rewarder = Rewarder.from_file(settings.feedback.reward_config)
window_s = settings.feedback.reward_window_s

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
raw = dict(key_serializer="raw", value_serializer="raw")
incoming = app.topic(Topics.TRAJECTORIES, Topics.FEEDBACK, Topics.WINDOW_CLOSE, **raw)
window_close = app.topic(Topics.WINDOW_CLOSE, **raw)
samples_topic = app.topic(Topics.SAMPLES, **raw)
dead_letters = app.topic(Topics.DEAD_LETTER, **raw)
# Keyed by join_key(tenant, completion_id), JSON state; partitioned like the incoming
# topics (the Kafka key stays the completion_id).
completions = app.Table("completions", default=None)
# Keys sent to WINDOW_CLOSE and not yet closed, so each sweep does not resend them.
closing: set[str] = set()


def join_key(tenant: str, completion_id: str) -> str:
    """The tenant-scoped name of a completion: the table key and the sample id.
    Unambiguous because tenant names hold no ':' (liverl.keys)."""
    return f"{tenant}:{completion_id}"


async def dead_letter(topic: str, reason: str, payload: bytes, tenant: str | None = None) -> None:
    digest = hashlib.sha256(topic.encode() + payload).hexdigest()[:32]
    letter = DeadLetter(event_id=f"dlq-{digest}", source_topic=topic, reason=reason,
                        tenant=tenant, payload=payload.decode(errors="replace"))
    await dead_letters.send(key=digest.encode(), value=encode(letter))
    EVENTS.labels(topic, "dead_letter").inc()


async def emit(state: dict[str, Any], result: RewardResult, source: str) -> None:
    trajectory = Trajectory.model_validate(state["trajectory"])
    state["revision"] += 1
    sample_id = join_key(trajectory.tenant, trajectory.completion_id)
    sample = RewardedSample(
        sample_id=sample_id,
        revision=state["revision"],
        event_id=f"{sample_id}:r{state['revision']}",
        tenant=trajectory.tenant,
        reward=result.reward,
        reward_source=source,
        reward_fn_version=result.fn_version,
        feedback_event_ids=[f["event_id"] for f in state["feedback"]],
        accepted=result.accepted,
        trajectory=trajectory,
    )
    await samples_topic.send(
        key=trajectory.completion_id.encode(), value=encode(sample)
    )
    SAMPLES.labels(source).inc()


async def score_and_emit(state: dict[str, Any]) -> None:
    trajectory = Trajectory.model_validate(state["trajectory"])
    events = [FeedbackEvent.model_validate(f) for f in state["feedback"]]
    await emit(state, rewarder.score(trajectory, events), "late" if state["closed"] else "feedback")


def parse(topic: str, raw: bytes) -> Trajectory | FeedbackEvent:
    model = Trajectory if topic == Topics.TRAJECTORIES else FeedbackEvent
    return model.model_validate_json(raw)


@app.agent(incoming)
async def join(stream):
    async for event in stream.events():
        topic, raw = event.message.topic, event.value
        try:
            if topic == Topics.WINDOW_CLOSE:
                await close_window(join_key(raw.decode(), event.key.decode()))
            else:
                await handle(topic, raw)
        except Exception as error:  # one poisoned event must not stop the join
            logger.exception("join failed")
            await dead_letter(topic, f"processing failed: {error!r}", raw)


async def handle(topic: str, raw: bytes) -> None:
    try:
        parsed = parse(topic, raw)
    except ValidationError as error:
        await dead_letter(topic, f"malformed: {error.errors()[0]['msg']}", raw)
        return
    completion_id = parsed.completion_id if isinstance(parsed, Trajectory) else parsed.body.completion_id
    key = join_key(parsed.tenant, completion_id)
    state = completions.get(key) or {
        "trajectory": None, "feedback": [], "event_ids": [], "revision": -1,
        "closed": False, "first_seen": time.time(),
    }
    if parsed.event_id in state["event_ids"]:
        EVENTS.labels(topic, "duplicate").inc()
        return
    if isinstance(parsed, Trajectory):
        if state["trajectory"] is not None:
            await dead_letter(topic, "a trajectory with this completion_id exists", raw, parsed.tenant)
            return
        state["trajectory"] = parsed.model_dump(mode="json")
        if state["feedback"]:
            await score_and_emit(state)
    else:
        if len(state["feedback"]) >= settings.feedback.max_feedback_per_completion:
            # The whole state is rewritten to the changelog on every event: unbounded,
            # one chatty completion would cost quadratic time and broker memory.
            await dead_letter(topic, f"more than {settings.feedback.max_feedback_per_completion} "
                              "feedback events for this completion", raw, parsed.tenant)
            return
        state["feedback"].append(parsed.model_dump(mode="json"))
        if state["closed"]:
            EVENTS.labels(topic, "late").inc()
        if state["trajectory"] is not None:
            await score_and_emit(state)
    state["event_ids"].append(parsed.event_id)
    EVENTS.labels(topic, "joined").inc()
    completions[key] = state


def window_due(state: dict[str, Any] | None, now: float) -> bool:
    """Whether the sweep has something to do for this completion."""
    if state is None or state["closed"]:
        # A closed entry stays one more window as a tombstone to catch late duplicates.
        return state is not None and now - state["first_seen"] > 2 * window_s
    if state["trajectory"] is None:
        return now - state["first_seen"] > window_s
    # Only the timestamp: a full Trajectory validation per open window per sweep is waste.
    return now - datetime.fromisoformat(state["trajectory"]["timestamp"]).timestamp() > window_s


@app.timer(interval=settings.feedback.sweep_interval_s)
async def sweep() -> None:
    now = time.time()
    for key, state in list(completions.items()):
        if key not in closing and window_due(state, now):
            closing.add(key)
            # Keyed by the completion id, like the incoming topics, so the close reaches
            # the agent that owns this table key; the tenant rides in the value.
            tenant, completion_id = key.split(":", 1)
            await window_close.send(key=completion_id.encode(), value=tenant.encode())


async def close_window(key: str) -> None:
    """Default rewards for silent completions; unjoinable feedback to the dead-letter topic."""
    closing.discard(key)
    state = completions.get(key)
    if not window_due(state, time.time()):
        return  # already closed by an earlier request
    if state["closed"]:
        del completions[key]
        return
    trajectory = state["trajectory"]
    if trajectory is None:
        for f in state["feedback"]:
            await dead_letter(Topics.FEEDBACK, "unjoinable: no trajectory for this "
                              "completion_id within the reward window",
                              encode(FeedbackEvent.model_validate(f)), f["tenant"])
        del completions[key]
        return
    if state["revision"] < 0 and (result := rewarder.default(Trajectory.model_validate(trajectory))):
        await emit(state, result, "default")
    state["closed"] = True
    completions[key] = state


if __name__ == "__main__":
    app.main()
