"""The feedback join as a state machine: no Kafka, no faust, no clock of its own.

Trajectories and feedback meet per tenant and completion (a completion id is the
tenant's own name: another tenant using the same id shares nothing with it). The state
of one completion is plain JSON data, what the stream's faust table holds:

    {"trajectory": {...} | None, "feedback": [...], "event_ids": [...],
     "revision": -1, "closed": False, "first_seen": epoch seconds}

- feedback may arrive before its trajectory: it waits, up to the reward window;
- the first feedback on a known trajectory emits revision 0 of the sample; more
  feedback inside the window emits revision 1, 2, ... (the learner keeps the latest
  revision it has not trained on yet);
- when the window closes with no feedback, the tenant's default reward (if any);
- feedback after the window closed is counted late and still emits a revision;
- a closed completion stays one more window as a tombstone that catches late duplicates;
- duplicates (same event_id) are dropped; malformed or unjoinable events, and feedback
  past `max_feedback` per completion, become dead letters with the reason.

Each step takes the time (`now`, epoch seconds) and returns what to send and count
(`Emitted`); `feedback/stream.py` only wires it to topics, a table and a timer.
"""

from __future__ import annotations

import hashlib
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

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

State = dict[str, Any]
UNJOINABLE = "unjoinable: no trajectory for this completion_id within the reward window"


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

    def refuse(self, topic: str, reason: str, payload: bytes, tenant: str | None = None) -> None:
        self.dead_letters.append(dead_letter(topic, reason, payload, tenant))
        self.counts.append((topic, "dead_letter"))


def parse(topic: str, raw: bytes) -> Trajectory | FeedbackEvent:
    model = Trajectory if topic == Topics.TRAJECTORIES else FeedbackEvent
    return model.model_validate_json(raw)


def new_state(now: float) -> State:
    return {"trajectory": None, "feedback": [], "event_ids": [], "revision": -1,
            "closed": False, "first_seen": now}


class FeedbackJoin:
    """The join over `states` (join_key -> State): a plain dict in tests, the faust table
    in the stream, which may only be written by the agent owning the key's partition."""

    def __init__(self, states: MutableMapping[str, State], rewarder: Rewarder,
                 window_s: float, max_feedback: int):
        self.states = states
        self.rewarder = rewarder
        self.window_s = window_s
        self.max_feedback = max_feedback
        # Keys named by windows_due and not closed yet, so each sweep does not name them again.
        self.close_requested: set[str] = set()

    def arrived(self, topic: str, raw: bytes, now: float) -> Emitted:
        """A trajectory (on Topics.TRAJECTORIES) or a feedback event (any other topic)."""
        out = Emitted()
        try:
            event = parse(topic, raw)
        except ValidationError as error:
            out.refuse(topic, f"malformed: {error.errors()[0]['msg']}", raw)
            return out
        completion_id = event.completion_id if isinstance(event, Trajectory) else event.body.completion_id
        key = join_key(event.tenant, completion_id)
        state = self.states.get(key) or new_state(now)
        if event.event_id in state["event_ids"]:
            out.counts.append((topic, "duplicate"))
            return out
        if isinstance(event, Trajectory):
            joined = self._trajectory_arrived(state, event, topic, raw, now, out)
        else:
            joined = self._feedback_arrived(state, event, topic, raw, now, out)
        if joined:
            state["event_ids"].append(event.event_id)
            out.counts.append((topic, "joined"))
            self.states[key] = state
        return out

    def _trajectory_arrived(self, state: State, trajectory: Trajectory, topic: str, raw: bytes,
                            now: float, out: Emitted) -> bool:
        if state["trajectory"] is not None:
            out.refuse(topic, "a trajectory with this completion_id exists", raw, trajectory.tenant)
            return False
        state["trajectory"] = trajectory.model_dump(mode="json")
        if state["feedback"]:
            self._score(state, now, out)
        return True

    def _feedback_arrived(self, state: State, event: FeedbackEvent, topic: str, raw: bytes,
                          now: float, out: Emitted) -> bool:
        if len(state["feedback"]) >= self.max_feedback:
            # The whole state is rewritten to the changelog on every event: unbounded,
            # one chatty completion would cost quadratic time and broker memory.
            out.refuse(topic, f"more than {self.max_feedback} feedback events for this completion",
                       raw, event.tenant)
            return False
        state["feedback"].append(event.model_dump(mode="json"))
        if state["closed"]:
            out.counts.append((topic, "late"))
        if state["trajectory"] is not None:
            self._score(state, now, out)
        return True

    def _score(self, state: State, now: float, out: Emitted) -> None:
        trajectory = Trajectory.model_validate(state["trajectory"])
        events = [FeedbackEvent.model_validate(f) for f in state["feedback"]]
        result = self.rewarder.score(trajectory, events)
        self._emit(state, result, "late" if state["closed"] else "feedback", now, out)

    def _emit(self, state: State, result: RewardResult, source: Literal["feedback", "default", "late"], now: float,
              out: Emitted) -> None:
        trajectory = Trajectory.model_validate(state["trajectory"])
        state["revision"] += 1
        sample_id = join_key(trajectory.tenant, trajectory.completion_id)
        out.samples.append(RewardedSample(
            sample_id=sample_id,
            revision=state["revision"],
            event_id=f"{sample_id}:r{state['revision']}",
            tenant=trajectory.tenant,
            timestamp=datetime.fromtimestamp(now, UTC),
            reward=result.reward,
            reward_source=source,
            reward_fn_version=result.fn_version,
            feedback_event_ids=[f["event_id"] for f in state["feedback"]],
            accepted=result.accepted,
            trajectory=trajectory,
        ))

    def is_due(self, state: State | None, now: float) -> bool:
        """Whether closing this completion's window has something to do."""
        if state is None or state["closed"]:
            return state is not None and now - state["first_seen"] > 2 * self.window_s
        if state["trajectory"] is None:
            return now - state["first_seen"] > self.window_s
        # Only the timestamp: a full Trajectory validation per open window per sweep is waste.
        return now - datetime.fromisoformat(state["trajectory"]["timestamp"]).timestamp() > self.window_s

    def windows_due(self, now: float) -> list[str]:
        """The keys whose window should close now; each is named once until close_window."""
        due = [key for key, state in list(self.states.items())
               if key not in self.close_requested and self.is_due(state, now)]
        self.close_requested.update(due)
        return due

    def close_window(self, key: str, now: float) -> Emitted:
        """Default rewards for silent completions; unjoinable feedback to dead letters;
        a closed completion's tombstone dropped."""
        out = Emitted()
        self.close_requested.discard(key)
        state = self.states.get(key)
        if state is None or not self.is_due(state, now):
            return out  # already closed by an earlier request
        if state["closed"]:
            del self.states[key]
            return out
        trajectory = state["trajectory"]
        if trajectory is None:
            for f in state["feedback"]:
                out.refuse(Topics.FEEDBACK, UNJOINABLE, encode(FeedbackEvent.model_validate(f)), f["tenant"])
            del self.states[key]
            return out
        if state["revision"] < 0 and (result := self.rewarder.default(Trajectory.model_validate(trajectory))):
            self._emit(state, result, "default", now, out)
        state["closed"] = True
        self.states[key] = state
        return out
