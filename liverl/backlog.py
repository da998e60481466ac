"""The feedback stream's and the sink's backlog as on-call sees it: what each stage has not
processed yet, and how long ago the oldest of it was produced.

The supervisor's backlog watch (`app/backlog_watch.py`) measures it every few seconds and
writes it here; `liverl status` and the dashboard read it. A record several components
read, so it lives in the shared core.
"""

from __future__ import annotations

import os
import time

from pydantic import BaseModel, Field

from liverl.settings import Settings

# Stage -> the consumer group that does its work (app/stack.py's DRAINED_GROUPS).
STAGE_GROUPS = {"stream": "liverl-feedback", "sink": "liverl-sink"}


class Backlog(BaseModel):
    """One consumer group's backlog."""

    messages: int = Field(description="Messages produced and not yet committed by the group.")
    oldest_s: float | None = Field(None, description="Since the oldest of them was produced; None: none waiting.")
    waiting: dict[str, int] = Field(default_factory=dict, description="Each partition with messages waiting "
                                    "('topic:partition'), with the offset the group committed there: unchanged "
                                    "while messages wait means that partition is not moving.")


class BacklogReport(BaseModel):
    at: float = Field(description="When it was measured (unix seconds).")
    alert_s: float = Field(description="The age past which on-call is alerted (supervisor.backlog_alert_s).")
    stages: dict[str, Backlog | None] = Field(description="Per stage; None: the broker did not answer.")

    def late(self) -> list[str]:
        """The stages whose oldest waiting event is older than the alert's age."""
        return [stage for stage, b in self.stages.items() if b and b.oldest_s is not None and b.oldest_s > self.alert_s]

    def age_s(self) -> float:
        return time.time() - self.at


def backlog_file(settings: Settings):
    return settings.run_dir / "backlog.json"


def write_backlog(settings: Settings, report: BacklogReport) -> None:
    """Whole or not at all: a reader never sees half a report."""
    path = backlog_file(settings)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(report.model_dump_json())
    os.replace(tmp, path)


def read_backlog(settings: Settings) -> BacklogReport | None:
    """The watch's latest report; None before its first (or with no supervisor)."""
    try:
        return BacklogReport.model_validate_json(backlog_file(settings).read_text())
    except (OSError, ValueError):
        return None


def backlog_view(settings: Settings) -> dict | None:
    """The latest report as status and the dashboard show it: with its age and the stages
    past the alert's age; None before the watch's first."""
    report = read_backlog(settings)
    return None if report is None else dict(report.model_dump(), measured_s_ago=round(report.age_s(), 1),
                                            late=report.late())
