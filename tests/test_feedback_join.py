"""The feedback join on its own: a fake clock and a plain dict for the states, one
semantic per test. `test_data_plane.py` checks the wiring to Kafka end to end."""

from __future__ import annotations

import copy
from datetime import UTC, datetime

import pytest

from feedback.join import UNJOINABLE, FeedbackJoin, join_key
from feedback.rewards import RewardConfig, RewardConfigFile, Rewarder
from liverl.contracts import FeedbackEvent, Topics, Trajectory
from liverl.kafka import encode

T0 = 1_800_000_000.0  # the fake clock's start, epoch seconds
WINDOW = 60.0
KEY = join_key("acme", "c1")


def make_join(default_reward: float | None = None, max_feedback: int = 4) -> FeedbackJoin:
    config = RewardConfigFile(tenants={"acme": RewardConfig(default_reward=default_reward, reject=-1.0)})
    return FeedbackJoin({}, Rewarder(config), window_s=WINDOW, max_feedback=max_feedback)


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, UTC)


def trajectory(event_id: str = "t1", completion_id: str = "c1", tenant: str = "acme") -> bytes:
    return encode(Trajectory(event_id=event_id, tenant=tenant, completion_id=completion_id,
                             policy_version="v0", completion_text="x = 1", timestamp=at(0)))


def feedback(event_id: str, kind: str = "accept", seconds: float = 1.0, completion_id: str = "c1",
             tenant: str = "acme") -> bytes:
    return encode(FeedbackEvent.model_validate({
        "event_id": event_id, "tenant": tenant, "timestamp": at(seconds),
        "body": {"kind": kind, "completion_id": completion_id}}))


def close_due_windows(join: FeedbackJoin, now: float) -> list:
    """What the sweep and the window-close topic do together: close every due window."""
    return [join.close_window(key, now) for key in join.windows_due(now)]


def test_feedback_inside_the_window_emits_revision_zero():
    join = make_join()
    assert join.arrived(Topics.TRAJECTORIES, trajectory(), T0).samples == []
    out = join.arrived(Topics.FEEDBACK, feedback("f1"), T0 + 1)
    [sample] = out.samples
    assert (sample.sample_id, sample.revision, sample.event_id) == (KEY, 0, f"{KEY}:r0")
    assert (sample.reward, sample.accepted, sample.reward_source) == (1.0, True, "feedback")
    assert sample.feedback_event_ids == ["f1"] and sample.timestamp == at(1)
    assert out.counts == [(Topics.FEEDBACK, "joined")]


def test_more_feedback_in_the_window_emits_the_next_revisions_scored_by_the_latest():
    join = make_join()
    join.arrived(Topics.TRAJECTORIES, trajectory(), T0)
    join.arrived(Topics.FEEDBACK, feedback("f1", "accept", seconds=1), T0 + 1)
    [second] = join.arrived(Topics.FEEDBACK, feedback("f2", "reject", seconds=2), T0 + 2).samples
    assert (second.revision, second.reward, second.accepted) == (1, -1.0, False)
    assert second.feedback_event_ids == ["f1", "f2"]
    # A signal stamped earlier arrives last: a new revision, still scored by the latest signal.
    [third] = join.arrived(Topics.FEEDBACK, feedback("f3", "accept", seconds=0.5), T0 + 3).samples
    assert (third.revision, third.reward, third.feedback_event_ids) == (2, -1.0, ["f1", "f2", "f3"])


def test_feedback_before_its_trajectory_waits_for_it():
    join = make_join()
    assert join.arrived(Topics.FEEDBACK, feedback("f1"), T0).samples == []
    [sample] = join.arrived(Topics.TRAJECTORIES, trajectory(), T0 + 1).samples
    assert (sample.revision, sample.reward_source, sample.feedback_event_ids) == (0, "feedback", ["f1"])


def test_window_closes_with_the_default_reward_when_nobody_answered():
    join = make_join(default_reward=0.25)
    join.arrived(Topics.TRAJECTORIES, trajectory(), T0)
    assert join.windows_due(T0 + WINDOW) == []  # due only once the window has passed
    [closed] = close_due_windows(join, T0 + WINDOW + 1)
    [sample] = closed.samples
    assert (sample.revision, sample.reward, sample.accepted, sample.reward_source) == (0, 0.25, None, "default")
    assert sample.feedback_event_ids == [] and join.states[KEY]["closed"]


def test_window_closes_without_a_sample_when_the_tenant_has_no_default():
    join = make_join(default_reward=None)
    join.arrived(Topics.TRAJECTORIES, trajectory(), T0)
    [closed] = close_due_windows(join, T0 + WINDOW + 1)
    assert closed.samples == [] and closed.dead_letters == [] and join.states[KEY]["closed"]


def test_window_measures_from_the_trajectory_timestamp_not_its_arrival():
    join = make_join(default_reward=0.25)
    join.arrived(Topics.TRAJECTORIES, trajectory(), T0 + 30)  # stamped T0, arrived 30 s later
    assert join.windows_due(T0 + WINDOW + 1) == [KEY]


def test_no_default_reward_once_feedback_gave_one():
    join = make_join(default_reward=0.25)
    join.arrived(Topics.TRAJECTORIES, trajectory(), T0)
    join.arrived(Topics.FEEDBACK, feedback("f1"), T0 + 1)
    [closed] = close_due_windows(join, T0 + WINDOW + 1)
    assert closed.samples == [] and join.states[KEY]["revision"] == 0


@pytest.mark.parametrize("default_reward, revision", [(None, 0), (0.25, 1)])
def test_late_feedback_after_the_close_is_a_new_revision(default_reward, revision):
    join = make_join(default_reward=default_reward)
    join.arrived(Topics.TRAJECTORIES, trajectory(), T0)
    close_due_windows(join, T0 + WINDOW + 1)
    out = join.arrived(Topics.FEEDBACK, feedback("late", seconds=WINDOW + 2), T0 + WINDOW + 2)
    [sample] = out.samples
    assert (sample.revision, sample.reward_source, sample.reward) == (revision, "late", 1.0)
    assert out.counts == [(Topics.FEEDBACK, "late"), (Topics.FEEDBACK, "joined")]


def test_a_duplicate_event_changes_nothing():
    join = make_join()
    join.arrived(Topics.TRAJECTORIES, trajectory(), T0)
    join.arrived(Topics.FEEDBACK, feedback("f1"), T0 + 1)
    before = copy.deepcopy(join.states)
    for topic, raw in [(Topics.FEEDBACK, feedback("f1")), (Topics.TRAJECTORIES, trajectory())]:
        out = join.arrived(topic, raw, T0 + 2)
        assert (out.samples, out.dead_letters, out.counts) == ([], [], [(topic, "duplicate")])
    assert join.states == before


def test_a_closed_completion_catches_duplicates_for_one_more_window_then_goes():
    join = make_join()
    join.arrived(Topics.TRAJECTORIES, trajectory(), T0)
    join.arrived(Topics.FEEDBACK, feedback("f1"), T0 + 1)
    close_due_windows(join, T0 + WINDOW + 1)
    assert join.windows_due(T0 + 2 * WINDOW) == []  # the tombstone is not due yet
    assert join.arrived(Topics.FEEDBACK, feedback("f1"), T0 + 2 * WINDOW).counts == [(Topics.FEEDBACK, "duplicate")]
    [dropped] = close_due_windows(join, T0 + 2 * WINDOW + 1)
    assert dropped.samples == [] and dropped.dead_letters == [] and KEY not in join.states


def test_a_window_is_named_once_until_it_closes_and_a_second_close_does_nothing():
    join = make_join(default_reward=0.25)
    join.arrived(Topics.TRAJECTORIES, trajectory(), T0)
    assert join.windows_due(T0 + WINDOW + 1) == [KEY]
    assert join.windows_due(T0 + WINDOW + 2) == []  # requested, not closed yet
    assert len(join.close_window(KEY, T0 + WINDOW + 3).samples) == 1
    again = join.close_window(KEY, T0 + WINDOW + 4)  # a close requested twice
    assert again.samples == [] and join.states[KEY]["revision"] == 0


def test_feedback_for_an_unknown_completion_is_unjoinable_when_its_window_closes():
    join = make_join(default_reward=0.25)
    join.arrived(Topics.FEEDBACK, feedback("f1", completion_id="nobody"), T0)
    [closed] = close_due_windows(join, T0 + WINDOW + 1)
    [letter] = closed.dead_letters
    assert (letter.reason, letter.tenant, letter.source_topic) == (UNJOINABLE, "acme", Topics.FEEDBACK)
    assert FeedbackEvent.model_validate_json(letter.payload).event_id == "f1"
    assert closed.samples == [] and join.states == {}


def test_tenants_sharing_a_completion_id_share_nothing():
    join = make_join()
    join.arrived(Topics.TRAJECTORIES, trajectory(), T0)
    assert join.arrived(Topics.FEEDBACK, feedback("m1", tenant="mallory"), T0 + 1).samples == []
    assert set(join.states) == {KEY, join_key("mallory", "c1")}
    assert join.states[KEY]["revision"] == -1


def test_feedback_past_the_cap_per_completion_is_a_dead_letter():
    join = make_join(max_feedback=2)
    join.arrived(Topics.TRAJECTORIES, trajectory(), T0)
    for i in range(2):
        join.arrived(Topics.FEEDBACK, feedback(f"f{i}"), T0 + 1)
    out = join.arrived(Topics.FEEDBACK, feedback("f2"), T0 + 2)
    [letter] = out.dead_letters
    assert letter.reason == "more than 2 feedback events for this completion" and letter.tenant == "acme"
    assert out.samples == [] and out.counts == [(Topics.FEEDBACK, "dead_letter")]
    assert len(join.states[KEY]["feedback"]) == 2 and join.states[KEY]["revision"] == 1


def test_a_second_trajectory_for_a_completion_is_a_dead_letter():
    join = make_join()
    join.arrived(Topics.TRAJECTORIES, trajectory("t1"), T0)
    before = copy.deepcopy(join.states)
    [letter] = join.arrived(Topics.TRAJECTORIES, trajectory("t2"), T0 + 1).dead_letters
    assert letter.reason == "a trajectory with this completion_id exists" and join.states == before


def test_a_malformed_event_is_a_dead_letter_with_the_reason():
    join = make_join()
    out = join.arrived(Topics.FEEDBACK, b'{"event_id": "f1"}', T0)
    [letter] = out.dead_letters
    assert letter.reason.startswith("malformed: ") and letter.payload == '{"event_id": "f1"}'
    assert join.states == {}
    # The same refusal twice is one letter downstream: its id hashes topic and payload.
    assert join.arrived(Topics.FEEDBACK, b'{"event_id": "f1"}', T0).dead_letters[0].event_id == letter.event_id
