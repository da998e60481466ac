"""The feedback join as a state machine: no Kafka, no clock of its own.

Trajectories and feedback meet per tenant and completion (a completion id is the
tenant's own name: another tenant using the same id shares nothing with it). The state
of one completion is a `CompletionState`, what the stream's worker holds (as JSON in
its changelog, parsed once when a partition's states are restored).

- feedback may arrive before its trajectory: it waits, up to the reward window;
- the first feedback on a known trajectory emits revision 0 of the sample; more
  feedback inside the window emits revision 1, 2, ... (the learner keeps the latest
  revision it has not trained on yet);
- when the window closes with no feedback, the tenant's default reward (if any);
- feedback after the window closed is counted late and still emits a revision;
- a closed completion stays one more window as a tombstone that catches late duplicates;
- duplicates (same event_id) are dropped; malformed or unjoinable events, feedback past
  `max_feedback` per completion, and feedback past `max_unjoined` waiting for its
  trajectory per tenant, become dead letters with the reason.

Each step takes the time (`now`, epoch seconds) and returns what to send and count
(`Emitted`); it notes which states changed (`take_changed`), so the stream writes each
changed state to its table once per batch. Open windows are indexed by the time they
close (a heap), so closing them costs per window due, not per window open. Windows
close by the stream's time (`feedback/stream_time.py`), not the clock: feedback read
ahead of a trajectory still waiting in a backlog is not called unjoinable.
`feedback/stream.py` only wires it to topics, a table and a timer.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
from collections import Counter
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from feedback.rewards import Rewarder, RewardResult
from liverl.contracts import (
    DeadLetter,
    FeedbackEvent,
    RewardedSample,
    Topics,
    Trajectory,
)
from liverl.kafka import encode

logger = logging.getLogger(__name__)
UNJOINABLE = "unjoinable: no trajectory for this completion_id within the reward window"


class CompletionState(BaseModel):
    """One completion's join state, typed: parsed once (from an event, or from the table's
    changelog on recovery), never re-validated per event."""

    trajectory: Trajectory | None = None
    feedback: list[FeedbackEvent] = Field(default_factory=list)
    event_ids: list[str] = Field(default_factory=list)
    revision: int = -1
    closed: bool = False
    first_seen: float = Field(description="When the join first saw the completion, epoch seconds.")
    partition: int = Field(0, description="The source partition its events arrive on: where its table "
                           "entry is changelogged, so the worker that owns the partition recovers it.")

    def __getitem__(self, name: str) -> Any:
        """Fields by name too, as they were read when the state was a JSON dict."""
        return getattr(self, name)

    def due_at(self, window_s: float) -> float:
        """When closing its window has something to do: default reward or unjoinable one
        window after it was served (or first seen, without a trajectory); a tombstone's drop
        two windows after it was first seen. Derived from what the state holds, so a
        restarted worker keeps every window's original deadline."""
        if self.closed:
            return self.first_seen + 2 * window_s
        if self.trajectory is None:
            return self.first_seen + window_s
        return self.trajectory.timestamp.timestamp() + window_s


State = CompletionState


def join_key(tenant: str, completion_id: str) -> str:
    """The tenant-scoped name of a completion: the table key and the sample id.
    Unambiguous because tenant names hold no ':' (liverl.keys)."""
    return f"{tenant}:{completion_id}"


def dead_letter(topic: str, reason: str, payload: bytes, tenant: str | None = None) -> DeadLetter:
    """Its id hashes topic and payload, so the same refusal twice is one letter downstream."""
    digest = hashlib.sha256(topic.encode() + payload).hexdigest()[:32]
    return DeadLetter(event_id=f"dlq-{digest}", source_topic=topic, reason=reason,
                      tenant=tenant, payload=payload.decode(errors="replace"))


@dataclass
class Emitted:
    """What one step of the join asks the wiring to send, and the (topic, outcome) to count."""

    samples: list[RewardedSample] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    counts: list[tuple[str, str]] = field(default_factory=list)
    overflowed: list[str] = field(default_factory=list)  # a tenant per feedback over its unjoined bound

    def refuse(self, topic: str, reason: str, payload: bytes, tenant: str | None = None) -> None:
        self.dead_letters.append(dead_letter(topic, reason, payload, tenant))
        self.counts.append((topic, "dead_letter"))

    def extend(self, other: Emitted) -> None:
        self.samples += other.samples
        self.dead_letters += other.dead_letters
        self.counts += other.counts
        self.overflowed += other.overflowed


def parse(topic: str, raw: bytes) -> Trajectory | FeedbackEvent:
    model = Trajectory if topic == Topics.TRAJECTORIES else FeedbackEvent
    return model.model_validate_json(raw)


def new_state(now: float, partition: int = 0) -> State:
    # Not model_construct: pydantic 2.14 inspects each default_factory's signature per call
    # there (141 us a state against 1 us validated).
    return CompletionState(first_seen=now, partition=partition)


class FeedbackJoin:
    """The join over `states` (join_key -> CompletionState), a plain dict; the stream writes
    `take_changed()` to its changelog after each batch."""

    def __init__(self, states: MutableMapping[str, State], rewarder: Rewarder,
                 window_s: float, max_feedback: int, max_unjoined: int | None = None):
        self.states = states
        self.rewarder = rewarder
        self.window_s = window_s
        self.max_feedback = max_feedback
        self.max_unjoined = max_unjoined
        self.changed: dict[str, int] = {}  # key -> partition, written or deleted since take_changed
        self.reindex()

    def reindex(self) -> None:
        """The due index and each tenant's count of feedback waiting for a trajectory, from
        the states (at start and after the table is recovered)."""
        self.due = [(state.due_at(self.window_s), key) for key, state in self.states.items()]
        heapq.heapify(self.due)
        self.unjoined: Counter[str] = Counter()
        for key, state in self.states.items():
            if state.trajectory is None:
                self.unjoined[key.split(":", 1)[0]] += len(state.feedback)

    def take_changed(self) -> dict[str, int]:
        """The keys written or deleted since the last call, with their partitions."""
        changed, self.changed = self.changed, {}
        return changed

    def _store(self, key: str, state: State) -> None:
        self.states[key] = state
        self.changed[key] = state.partition

    def _drop(self, key: str, state: State) -> None:
        del self.states[key]
        self.changed[key] = state.partition

    def arrived(self, topic: str, raw: bytes, now: float, partition: int = 0) -> Emitted:
        """A trajectory (on Topics.TRAJECTORIES) or a feedback event (any other topic)."""
        out = Emitted()
        try:
            event = parse(topic, raw)
        except ValidationError as error:
            out.refuse(topic, f"malformed: {error.errors()[0]['msg']}", raw)
            return out
        completion_id = event.completion_id if isinstance(event, Trajectory) else event.body.completion_id
        key = join_key(event.tenant, completion_id)
        known = self.states.get(key)
        state = known or new_state(now, partition)
        if event.event_id in state.event_ids:
            out.counts.append((topic, "duplicate"))
            return out
        if isinstance(event, Trajectory):
            joined = self._trajectory_arrived(state, event, topic, raw, now, out)
        else:
            joined = self._feedback_arrived(state, event, topic, raw, now, out)
        if joined:
            state.event_ids.append(event.event_id)
            out.counts.append((topic, "joined"))
            self._store(key, state)
            if known is None or isinstance(event, Trajectory):  # else its deadline has not moved
                heapq.heappush(self.due, (state.due_at(self.window_s), key))
        return out

    def _trajectory_arrived(self, state: State, trajectory: Trajectory, topic: str, raw: bytes,
                            now: float, out: Emitted) -> bool:
        if state.trajectory is not None:
            out.refuse(topic, "a trajectory with this completion_id exists", raw, trajectory.tenant)
            return False
        state.trajectory = trajectory
        self.unjoined[trajectory.tenant] -= len(state.feedback)
        if state.feedback:
            self._score(state, now, out)
        return True

    def _feedback_arrived(self, state: State, event: FeedbackEvent, topic: str, raw: bytes,
                          now: float, out: Emitted) -> bool:
        if len(state.feedback) >= self.max_feedback:
            # The whole state is rewritten to the changelog on every change: unbounded,
            # one chatty completion would cost quadratic time and broker memory.
            out.refuse(topic, f"more than {self.max_feedback} feedback events for this completion",
                       raw, event.tenant)
            return False
        if state.trajectory is None:
            if self.max_unjoined is not None and self.unjoined[event.tenant] >= self.max_unjoined:
                # Feedback for completions nobody served would otherwise hold memory without a bound.
                out.refuse(topic, f"tenant {event.tenant} has {self.max_unjoined} feedback events waiting "
                           "for their trajectories already", raw, event.tenant)
                out.overflowed.append(event.tenant)
                return False
            self.unjoined[event.tenant] += 1
        state.feedback.append(event)
        if state.closed:
            out.counts.append((topic, "late"))
        if state.trajectory is not None:
            self._score(state, now, out)
        return True

    def _score(self, state: State, now: float, out: Emitted) -> None:
        assert state.trajectory is not None
        result = self.rewarder.score(state.trajectory, state.feedback)
        self._emit(state, result, "late" if state.closed else "feedback", now, out)

    def _emit(self, state: State, result: RewardResult, source: Literal["feedback", "default", "late"], now: float,
              out: Emitted) -> None:
        trajectory = state.trajectory
        assert trajectory is not None
        state.revision += 1
        sample_id = join_key(trajectory.tenant, trajectory.completion_id)
        out.samples.append(RewardedSample(
            sample_id=sample_id,
            revision=state.revision,
            event_id=f"{sample_id}:r{state.revision}",
            tenant=trajectory.tenant,
            timestamp=datetime.fromtimestamp(now, UTC),
            reward=result.reward,
            reward_source=source,
            reward_fn_version=result.fn_version,
            feedback_event_ids=[f.event_id for f in state.feedback],
            accepted=result.accepted,
            trajectory=trajectory,
        ))

    def is_due(self, state: State | None, now: float) -> bool:
        """Whether closing this completion's window has something to do."""
        return state is not None and now > state.due_at(self.window_s)

    def windows_due(self, now: float) -> list[str]:
        """The keys whose window should close now, from the due index: each is named once
        (an entry whose state has moved on since it was indexed is stale and skipped)."""
        due: list[str] = []
        while self.due and self.due[0][0] < now:
            at, key = heapq.heappop(self.due)
            state = self.states.get(key)
            if state is not None and state.due_at(self.window_s) == at:
                due.append(key)
        return due

    def close_window(self, key: str, now: float) -> Emitted:
        """Default rewards for silent completions; unjoinable feedback to dead letters;
        a closed completion's tombstone dropped."""
        out = Emitted()
        state = self.states.get(key)
        if state is None or not self.is_due(state, now):
            return out  # already closed by an earlier request
        if state.closed:
            self._drop(key, state)
            return out
        trajectory = state.trajectory
        if trajectory is None:
            for f in state.feedback:
                out.refuse(Topics.FEEDBACK, UNJOINABLE, encode(f), f.tenant)
            self.unjoined[key.split(":", 1)[0]] -= len(state.feedback)
            self._drop(key, state)
            return out
        if state.revision < 0 and (result := self.rewarder.default(trajectory)):
            self._emit(state, result, "default", now, out)
        state.closed = True
        self._store(key, state)
        heapq.heappush(self.due, (state.due_at(self.window_s), key))
        return out

    def process(self, batch: Sequence[tuple[str, bytes, int]], now: float,
                read_up_to: float = math.inf) -> Emitted:
        """A batch of (topic, payload, partition) in order, then every window due by
        `read_up_to`, the time up to which every event has been read (`StreamTime`; the
        default: this batch is all there is), and not after `now`: the batch's events are
        seen before a window closing at its time, and a trajectory still in a backlog
        before its window is called missing."""
        out = Emitted()
        for topic, raw, partition in batch:
            try:
                out.extend(self.arrived(topic, raw, now, partition))
            except Exception as error:  # one poisoned event (a team's reward hook...) must not stop the join
                logger.exception("join failed")
                out.refuse(topic, f"processing failed: {error!r}", raw)
        out.extend(self.close_due(min(now, read_up_to)))
        return out

    def close_due(self, now: float) -> Emitted:
        """Every window due by `now` (the stream's time, which lags the clock while it reads
        a backlog), closed."""
        out = Emitted()
        for key in self.windows_due(now):
            out.extend(self.close_window(key, now))
        return out
