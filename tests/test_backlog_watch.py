"""The backlog watch's stall rule, on reports it is handed (no broker): a stage is restarted
when one partition with events waiting stops moving, even while its others move."""

from __future__ import annotations

from app.backlog_watch import BacklogWatch
from liverl.backlog import Backlog
from liverl.settings import Settings, SupervisorConfig


def watch(tmp_path) -> tuple[BacklogWatch, list[str]]:
    restarts: list[str] = []
    settings = Settings(data_dir=tmp_path, supervisor=SupervisorConfig(backlog_stall_s=120))
    return BacklogWatch(settings, lambda *_: None, lambda component, why: restarts.append(why)), restarts


def test_one_partition_stuck_while_another_moves_is_a_stall(tmp_path):
    """Seen in the fault suite: a restarted stream worker committed on one of its four
    partitions for minutes and on none of the other three; the summed offsets kept moving."""
    backlog_watch, restarts = watch(tmp_path)
    for second, moving in ((0, 100), (60, 400), (119, 700)):
        backlog_watch.check_moving("stream", Backlog(messages=5_000, waiting={
            "liverl.feedback:0": 3_385, "liverl.trajectories:0": moving}), second)
    assert restarts == []
    backlog_watch.check_moving("stream", Backlog(messages=5_000, waiting={
        "liverl.feedback:0": 3_385, "liverl.trajectories:0": 900}), 121)
    assert len(restarts) == 1 and "liverl.feedback:0 for 121 s" in restarts[0]


def test_a_partition_that_moves_or_empties_is_not_a_stall(tmp_path):
    backlog_watch, restarts = watch(tmp_path)
    backlog_watch.check_moving("sink", Backlog(messages=10, waiting={"liverl.samples:0": 50}), 0)
    backlog_watch.check_moving("sink", Backlog(messages=0), 100)  # caught up: the clock starts again
    backlog_watch.check_moving("sink", Backlog(messages=10, waiting={"liverl.samples:0": 60}), 150)
    backlog_watch.check_moving("sink", None, 200)  # the broker did not answer: nothing concluded
    backlog_watch.check_moving("sink", Backlog(messages=10, waiting={"liverl.samples:0": 61}), 260)
    backlog_watch.check_moving("sink", Backlog(messages=10, waiting={"liverl.samples:0": 61}), 379)
    assert restarts == []
    backlog_watch.check_moving("sink", Backlog(messages=10, waiting={"liverl.samples:0": 61}), 380)
    assert len(restarts) == 1
