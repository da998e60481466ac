"""The backlog watch: every `supervisor.backlog_every_s` it measures what the feedback stream
and the sink have not processed yet (their consumer lag and the age of the oldest event
waiting), exports it as metrics, writes it for `liverl status` and the dashboard
(`liverl/backlog.py`), and alerts on-call once when a stage's oldest waiting event passes
`supervisor.backlog_alert_s` (again only after it has caught up). A stage with a partition
whose events wait and whose committed offset has not moved for `supervisor.backlog_stall_s`
is restarted through the supervisor.
Runs in the supervisor's process, on a thread of its own: a broker that does not answer must
not delay a restart.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from prometheus_client import Gauge

from app.stack import DRAINED_GROUPS, processes_of
from liverl.backlog import STAGE_GROUPS, Backlog, BacklogReport, write_backlog
from liverl.kafka import group_backlog
from liverl.observability import log, setup_logging
from liverl.settings import Settings

logger = setup_logging("supervisor")
MESSAGES = Gauge("liverl_backlog_messages", "Events a stage has not processed yet", ["stage"])
OLDEST = Gauge("liverl_backlog_oldest_seconds", "Since the oldest event a stage has not processed was produced "
               "(0: none waiting)", ["stage"])
ANSWER_S = 20.0  # a broker slower than this to answer is reported as not answering


class BacklogWatch:
    def __init__(self, settings: Settings, alert: Callable[[str, str], None], restart: Callable[[str, str], object]):
        self.settings, self.alert, self.restart = settings, alert, restart
        self.alerted: set[str] = set()  # stages late since the last alert: one alert an episode
        # stage -> partition -> (its committed offset, since when unchanged while events wait there)
        self.still: dict[str, dict[str, tuple[int, float]]] = {}

    def measure(self) -> BacklogReport:
        stages: dict[str, Backlog | None] = {}
        for stage, group in STAGE_GROUPS.items():
            try:
                stages[stage] = asyncio.run(asyncio.wait_for(
                    group_backlog(self.settings, group, DRAINED_GROUPS[group][1]), ANSWER_S))
            except Exception as error:  # the broker restarting, say: shown as unknown, never as 0
                log(logger, "backlog not measured", stage=stage, error=repr(error))
                stages[stage] = None
        return BacklogReport(at=time.time(), alert_s=self.settings.supervisor.backlog_alert_s, stages=stages)

    def check(self) -> BacklogReport:
        report = self.measure()
        write_backlog(self.settings, report)
        for stage, backlog in report.stages.items():
            if backlog is not None:
                MESSAGES.labels(stage).set(backlog.messages)
                OLDEST.labels(stage).set(backlog.oldest_s or 0.0)
        late = set(report.late())
        for stage in sorted(late - self.alerted):
            backlog = report.stages[stage]
            assert backlog is not None and backlog.oldest_s is not None  # late() says so
            self.alert(stage, f"the {stage}'s oldest unprocessed event is {backlog.oldest_s:.0f} s old "
                              f"({backlog.messages} waiting; alert past {report.alert_s:.0f} s)")
        self.alerted = late
        for stage, backlog in report.stages.items():
            self.check_moving(stage, backlog, report.at)
        return report

    def check_moving(self, stage: str, backlog: Backlog | None, now: float) -> None:
        """Restart a stage with a partition whose events wait and whose committed offset has not
        moved for `backlog_stall_s`: a consumer stuck inside a live process whose health page
        still answers (seen: faust's consumer thread stopped after a burst, for good). Per
        partition: a worker moving on one partition moves the sum. Commits that crawl (a few
        offsets a minute, seen after stream restarts in the fault suite) are not caught."""
        if backlog is None:
            return  # not measured: what was seen before stands
        before = self.still.get(stage, {})
        self.still[stage] = {key: before[key] if key in before and before[key][0] == committed else (committed, now)
                             for key, committed in backlog.waiting.items()}
        stuck = {key: now - since for key, (_, since) in self.still[stage].items()
                 if now - since >= self.settings.supervisor.backlog_stall_s}
        if stuck:
            key, seconds = max(stuck.items(), key=lambda item: item[1])
            component = DRAINED_GROUPS[STAGE_GROUPS[stage]][0]
            for name in processes_of(self.settings, component):  # which worker holds the partition: unknown
                self.restart(name, f"the {stage} committed nothing on {key} for {seconds:.0f} s with events "
                                   f"waiting there ({backlog.messages} waiting in all): restarted")
            del self.still[stage]

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.settings.supervisor.backlog_every_s):
            try:
                self.check()
            except Exception as error:  # the watch goes on; the supervisor's restarts never wait on it
                log(logger, "backlog watch failed", error=repr(error))
