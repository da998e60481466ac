"""The join in batches, as the stream runs it (`FeedbackJoin.process` per `take_events`):
what batching could break, the table written only where a state changed, windows that
keep their deadlines across a restart, and the bound on feedback waiting for trajectories."""

from __future__ import annotations

import math

from test_feedback_join import KEY, T0, WINDOW, feedback, make_join, trajectory

from feedback.join import UNJOINABLE, CompletionState, FeedbackJoin, join_key
from feedback.stream_time import StreamTime
from liverl.contracts import Topics
from liverl.kafka import encode

TRAJ, FEED = Topics.TRAJECTORIES, Topics.FEEDBACK


def test_two_events_of_one_completion_in_one_batch():
    join = make_join()
    out = join.process([(TRAJ, trajectory(), 1), (FEED, feedback("f1", "accept"), 1),
                        (FEED, feedback("f2", "reject", seconds=2), 1)], T0 + 2)
    assert [(s.revision, s.reward, s.feedback_event_ids) for s in out.samples] == [
        (0, 1.0, ["f1"]), (1, -1.0, ["f1", "f2"])]
    # One table write for the three events, on the partition they came from.
    assert join.take_changed() == {KEY: 1}
    assert join.states[KEY].event_ids == ["t1", "f1", "f2"] and join.states[KEY].partition == 1


def test_a_window_closing_inside_a_batch_sees_the_batch_first():
    join = make_join(default_reward=0.25)
    join.process([(TRAJ, trajectory("t1", "c1"), 0), (TRAJ, trajectory("t2", "c2"), 0),
                  (FEED, feedback("f3", completion_id="c3"), 0)], T0)
    # Both windows fall due inside this batch: c1's feedback in it is on time, c2 gets the
    # default, and c3's trajectory in it joins its waiting feedback rather than dead-lettering it.
    out = join.process([(FEED, feedback("f1", completion_id="c1"), 0), (TRAJ, trajectory("t3", "c3"), 0)],
                       T0 + WINDOW + 1)
    by_id = {s.sample_id: (s.revision, s.reward_source, s.reward) for s in out.samples}
    assert by_id == {KEY: (0, "feedback", 1.0), join_key("acme", "c2"): (0, "default", 0.25),
                     join_key("acme", "c3"): (0, "feedback", 1.0)}
    assert out.dead_letters == []
    # Served at T0, all three close in this batch, after its events.
    assert all(join.states[join_key("acme", c)].closed for c in ("c1", "c2", "c3"))


def test_a_duplicate_across_batches_changes_nothing_and_writes_nothing():
    join = make_join()
    join.process([(TRAJ, trajectory(), 0), (FEED, feedback("f1"), 0)], T0 + 1)
    join.take_changed()
    out = join.process([(FEED, feedback("f1"), 0), (TRAJ, trajectory(), 0)], T0 + 2)
    assert (out.samples, out.dead_letters) == ([], [])
    assert out.counts == [(FEED, "duplicate"), (TRAJ, "duplicate")]
    assert join.take_changed() == {}


def test_a_poisoned_event_is_a_dead_letter_and_the_batch_goes_on(monkeypatch):
    join = make_join()

    def broken(*_):
        raise ZeroDivisionError("a team's hook")
    monkeypatch.setattr(join.rewarder, "score", broken)  # a fault a real rewarder would not raise on demand
    out = join.process([(TRAJ, trajectory("t1", "c1"), 0), (FEED, feedback("f1", completion_id="c1"), 0),
                        (TRAJ, trajectory("t2", "c2"), 0)], T0 + 1)
    [letter] = out.dead_letters
    assert letter.reason.startswith("processing failed: ZeroDivisionError") and join_key("acme", "c2") in join.states


def test_windows_keep_their_deadlines_across_a_restart():
    """A restarted worker recovers the states from the table's changelog (their JSON) and
    closes each window when it was due, not one window after the restart."""
    join = make_join(default_reward=0.25)
    join.process([(TRAJ, trajectory("t1", "c1"), 0), (FEED, feedback("f2", completion_id="c2"), 1)], T0 + 10)
    changelog = {key: encode(join.states[key]) for key in join.take_changed()}
    restarted = FeedbackJoin({key: CompletionState.model_validate_json(raw) for key, raw in changelog.items()},
                             join.rewarder, window_s=WINDOW, max_feedback=4)
    assert restarted.states == join.states
    assert restarted.close_due(T0 + WINDOW).samples == []
    out = restarted.close_due(T0 + WINDOW + 11)  # c1 served at T0, c2's feedback first seen at T0 + 10
    assert [s.reward_source for s in out.samples] == ["default"]
    assert [d.reason for d in out.dead_letters] == [UNJOINABLE]


def test_feedback_waiting_for_trajectories_is_bounded_per_tenant():
    join = FeedbackJoin({}, make_join().rewarder, window_s=WINDOW, max_feedback=4, max_unjoined=2)
    out = join.process([(FEED, feedback(f"f{i}", completion_id=f"made-up-{i}"), 0) for i in range(3)]
                       + [(FEED, feedback("g1", completion_id="made-up-0", tenant="globex"), 0)], T0)
    [letter] = out.dead_letters
    assert letter.reason == "tenant acme has 2 feedback events waiting for their trajectories already"
    assert out.overflowed == ["acme"] and letter.tenant == "acme"
    assert join_key("acme", "made-up-2") not in join.states and join_key("globex", "made-up-0") in join.states
    # A trajectory that arrives makes room, and so does a window that closes unjoinable.
    assert join.process([(TRAJ, trajectory("t0", "made-up-0"), 0), (FEED, feedback("f3", completion_id="x"), 0),
                         (FEED, feedback("f4", completion_id="y"), 0)], T0 + 1).overflowed == ["acme"]
    join.process([], T0 + WINDOW + 2)
    assert join.process([(FEED, feedback("f5", completion_id="z"), 0)], T0 + WINDOW + 3).overflowed == []
    # A restart counts what waits from the recovered states.
    assert FeedbackJoin(join.states, join.rewarder, WINDOW, 4, max_unjoined=2).unjoined == join.unjoined


def test_feedback_read_ahead_of_its_trajectory_waits_for_the_stream_not_the_clock():
    """A worker behind a backlog reads one topic ahead of the other: the clock passes the
    window of feedback whose trajectory is still in the backlog. By the clock the feedback
    was dead-lettered as unjoinable and the sample lost (7,323 in a fault-suite run); the
    window closes when the stream has read past its deadline."""
    join = make_join()
    join.process([(FEED, feedback("f1"), 0)], T0, read_up_to=T0 - 600)
    # The clock is two windows on; the stream has read up to ten minutes ago.
    out = join.process([], T0 + 2 * WINDOW, read_up_to=T0 - 300)
    assert (out.samples, out.dead_letters) == ([], [])
    out = join.process([(TRAJ, trajectory(), 0)], T0 + 3 * WINDOW, read_up_to=T0 - 290)
    assert [(s.sample_id, s.revision, s.reward_source) for s in out.samples] == [(KEY, 0, "feedback")]
    assert out.dead_letters == []


def test_unjoined_feedback_is_dead_lettered_once_the_stream_has_read_past_its_window():
    join = make_join()
    join.process([(FEED, feedback("f1", completion_id="made-up"), 0)], T0)
    assert join.close_due(-math.inf).dead_letters == []  # the stream's place unknown: nothing closes
    assert join.process([], T0 + WINDOW + 1, read_up_to=T0 + WINDOW - 1).dead_letters == []
    out = join.process([], T0 + WINDOW + 5, read_up_to=T0 + WINDOW + 1)
    assert [d.reason for d in out.dead_letters] == [UNJOINABLE]


def test_the_stream_time_is_the_slowest_partition_and_an_idle_one_holds_nothing_back():
    clock = StreamTime()
    ends = {"trajectories:0": 100, "feedback:0": 50}
    assert clock.at(T0, ends) == -math.inf  # where either is read from: not known yet
    clock.starts_at("trajectories:0", 40)
    clock.starts_at("feedback:0", 50)  # read to its end already
    assert clock.at(T0, ends) == -math.inf  # 60 trajectories wait, of an age not known until one is read
    clock.processed("trajectories:0", 40, T0 - 120)
    clock.starts_at("trajectories:0", 10)  # a late answer about where it started changes nothing
    assert clock.at(T0, ends) == T0 - 120
    clock.processed("trajectories:0", 99, T0 - 3)
    assert clock.at(T0, ends) == T0  # both read to their ends: the clock's time
    assert clock.at(T0, {**ends, "feedback:0": None}) == -math.inf  # an end not fetched yet
    clock.forget(["trajectories:0"])
    assert clock.unplaced(ends) == ["trajectories:0"]


def test_a_place_taken_before_another_worker_read_on_is_moved_on():
    clock = StreamTime()
    ends = {"trajectories:0": 19}
    clock.starts_at("trajectories:0", 10)  # then the other worker read and committed to 19
    assert (clock.unplaced(ends), clock.at(T0, ends)) == (["trajectories:0"], -math.inf)
    clock.starts_at("trajectories:0", 19)  # asked again
    assert (clock.unplaced(ends), clock.at(T0, ends)) == ([], T0)
