"""A clean `liverl down` and `liverl up` loses none of the feedback stream's open reward windows:
every revision and every default reward they owe still comes out, once, at its original deadline.

    .venv/bin/python benchmarks/check_stream_down_up.py [--completions 40] [--window 100] [--runs 3]

Each run starts its own stack from an empty data directory (the embedded broker on disk, one
replica, no learner, every port moved by --port-offset), with a reward config that gives tenant
`dev` a default reward. Through the ingest API it sends, per kind, `--completions` of:

- heard: a trajectory and its feedback (revision 0 before the stop, a second feedback after the
  start: revision 1);
- silent: a trajectory and nothing (the default reward at its deadline, after the start);
- early: a trajectory served a while ago, whose deadline falls while the stack is stopped (the
  default reward as soon as the stream is back, never the start's time plus a window);
- orphan: feedback for a completion nobody served (a dead letter when its window closes).

Once every revision 0 is out, it stops the stack as `liverl down` does (the drain first), waits
--pause-s, starts it again as `liverl up` does, and reads the samples and dead-letter topics
whole: each outcome exactly once, each default between its deadline and the stack's return (or
its deadline, if later) plus a sweep. About three minutes a run, too long for the suite (its
short version there: tests/test_stream_restart.py, a kill instead of a clean stop). A run that
fails says what and exits 1; results: docs/reliability.md.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import wait_for  # noqa: E402
from test_stream_restart import feedback, ingest, read_all, trajectory  # noqa: E402

from app.stack import down, up, wipe_data_dir  # noqa: E402
from feedback.join import UNJOINABLE  # noqa: E402
from liverl.contracts import Topics  # noqa: E402
from liverl.settings import (  # noqa: E402
    EmbeddedBroker,
    FeedbackConfig,
    LearnerConfig,
    PortsConfig,
    ServingConfig,
    Settings,
)

console = Console()
DEFAULT_REWARD = 0.25
SWEEP_S = 1.0


def check_settings(data_dir: Path, offset: int, window: float) -> Settings:
    return Settings(
        data_dir=data_dir,
        ports=PortsConfig().shifted(10_000 + offset),
        broker=EmbeddedBroker(port=29092 + offset),
        serving=ServingConfig(replicas=1),
        feedback=FeedbackConfig(reward_window_s=window, sweep_interval_s=SWEEP_S,
                                reward_config=data_dir.parent / f"{data_dir.name}-rewards.yaml"),
        learner=LearnerConfig(enabled=False),
    )


def sent(settings: Settings) -> tuple[list[dict], list[dict]]:
    return read_all(settings, Topics.SAMPLES), read_all(settings, Topics.DEAD_LETTER)


def kind(sample_id: str) -> str:
    return sample_id.split("-")[1]  # dev:cmpl-KIND-...


def open_windows(settings: Settings, client: httpx.Client, n: int, window: float, early_s: float) -> dict:
    """Every kind's items sent; when every revision 0 is out (the windows are in the changelog)."""
    run = uuid.uuid4().hex[:8]
    ids = {k: [f"cmpl-{k}-{run}-{i}" for i in range(n)] for k in ("heard", "silent", "early", "orphan")}
    served_at = time.time()
    early_at = served_at - window + early_s  # its deadline: early_s from now, while the stack is stopped
    ingest(client, [trajectory(c, served_at) for c in ids["heard"] + ids["silent"]]
           + [trajectory(c, early_at) for c in ids["early"]]
           + [feedback(c, "accept") for c in ids["heard"] + ids["orphan"]])
    wait_for(lambda: sum(kind(s["sample_id"]) == "heard" for s in sent(settings)[0]) >= n, timeout=60, interval=1)
    deadlines = {f"dev:{c}": served_at + window for c in ids["silent"]}
    deadlines.update({f"dev:{c}": early_at + window for c in ids["early"]})
    return {"ids": ids, "served_at": served_at, "deadlines": deadlines}


def verdict(settings: Settings, opened: dict, up_at: float) -> dict:
    """Every outcome counted; the defaults' delays; what is wrong, if anything."""
    ids, deadlines = opened["ids"], opened["deadlines"]
    samples, letters = sent(settings)
    times = Counter((s["sample_id"], s["revision"]) for s in samples)
    expected = {(f"dev:{c}", r) for c in ids["heard"] for r in (0, 1)}
    expected |= {(f"dev:{c}", 0) for c in ids["silent"] + ids["early"]}
    letter_times = Counter(json.loads(d["payload"])["body"]["completion_id"] for d in letters
                           if d["reason"] == UNJOINABLE)
    late = {}  # a default outside [deadline, max(deadline, the stack's return) + a sweep + 2 s]
    delays = []
    for s in samples:
        if s["reward_source"] == "default":
            emitted, deadline = datetime.fromisoformat(s["timestamp"]).timestamp(), deadlines.get(s["sample_id"], 0)
            delays.append(emitted - deadline)
            if not deadline <= emitted <= max(deadline, up_at) + SWEEP_S + 2:
                late[s["sample_id"]] = round(emitted - deadline, 1)
    return {
        "lost": sorted(expected - times.keys()), "twice": sorted(k for k, n in times.items() if n > 1),
        "unexpected": sorted(times.keys() - expected),
        "letters_lost": sorted(set(ids["orphan"]) - letter_times.keys()),
        "letters_twice": sorted(c for c, n in letter_times.items() if n > 1),
        "defaults_off_time": late,
        "wrong_source": sorted(s["sample_id"] for s in samples if (s["reward_source"] == "default")
                               != (kind(s["sample_id"]) in ("silent", "early")) or s["reward"] is None),
        "revisions": len(expected), "defaults": len(delays),
        "default_delay_max_s": round(max(delays), 1) if delays else None,
    }


def one_run(settings: Settings, n: int, window: float, early_s: float, pause_s: float) -> dict:
    wipe_data_dir(settings)
    settings.data_dir.mkdir(parents=True)
    assert settings.feedback.reward_config is not None
    settings.feedback.reward_config.write_text(f"default:\n  default_reward: {DEFAULT_REWARD}\n")
    up(settings, say=console.print, progress=False)
    try:
        key = json.loads(settings.dev_keys_file.read_text())["tenant_key"]
        with httpx.Client(base_url=settings.url(settings.ports.api), timeout=30,
                          headers={"Authorization": f"Bearer {key}"}) as client:
            opened = open_windows(settings, client, n, window, early_s)
            stop_at = time.time()
            down(settings, say=console.print)  # `liverl down`: sources stopped, lag drained, the rest stopped
            stopped_at = time.time()
            time.sleep(pause_s)  # the operator's downtime, when the early windows fall due
            up(settings, say=console.print, progress=False)
            up_at = time.time()
            if up_at > opened["served_at"] + window - 10:
                raise RuntimeError(f"down and up took {up_at - stop_at:.0f} s: the windows closed meanwhile; "
                                   "raise --window")
            ingest(client, [feedback(c, "reject") for c in opened["ids"]["heard"]])
        # Revisions 0 and 1 of each heard, a default for each silent and early; a letter per orphan.
        wait_for(lambda: (out := sent(settings)) and len(out[0]) >= 4 * n and len(out[1]) >= n,
                 timeout=window + 60, interval=2)
        time.sleep(3 * SWEEP_S)  # anything sent twice would be out by now
        result = verdict(settings, opened, up_at)
    finally:
        down(settings, say=console.print)
    return dict(result, stop_s=round(stopped_at - stop_at, 1), start_s=round(up_at - stopped_at, 1),
                deadlines_while_stopped=sum(stopped_at < d < stopped_at + pause_s
                                            for d in opened["deadlines"].values()))


def main(data_dir: Path = typer.Option(Path("/tmp/liverl-check-down-up"), help="The stack's data directory."),
         port_offset: int = typer.Option(4500, help="Every port moved by this (as LIVERL_TEST_PORT_OFFSET)."),
         completions: int = typer.Option(40, min=1, help="Completions of each kind."),
         window: float = typer.Option(150.0, help="The reward window, seconds: longer than a down and up."),
         early_s: float = typer.Option(18.0, help="The early completions' deadline, seconds after they are sent: "
                                      "within the pause between down and up."),
         pause_s: float = typer.Option(20.0, help="Seconds between `down` and `up`."),
         runs: int = typer.Option(1, min=1, help="Runs, each on a fresh stack."),
         out: Path | None = typer.Option(None, help="Write every run's result as JSON here.")) -> None:
    results = []
    for i in range(runs):
        settings = check_settings(data_dir, port_offset, window)
        results.append(one_run(settings, completions, window, early_s, pause_s))
        console.print(f"run {i + 1}: {results[-1]}")
    table = Table(title="the stream's windows across `liverl down` and `liverl up`")
    for column in ("run", "outcomes", "lost", "twice", "defaults", "off time", "due while down", "letters lost",
                   "down s", "up s"):
        table.add_column(column, justify="right")
    for i, r in enumerate(results, 1):
        table.add_row(str(i), str(r["revisions"]), str(len(r["lost"])), str(len(r["twice"])), str(r["defaults"]),
                      str(len(r["defaults_off_time"])), str(r["deadlines_while_stopped"]), str(len(r["letters_lost"])),
                      str(r["stop_s"]),
                      str(r["start_s"]))
    console.print(table)
    if out:
        out.write_text(json.dumps(results, indent=2))
    failed = [r for r in results if any(r[k] for k in ("lost", "twice", "unexpected", "letters_lost",
                                                       "letters_twice", "defaults_off_time", "wrong_source"))]
    if failed:
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
