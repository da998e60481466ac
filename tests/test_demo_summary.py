"""The demo reports what users saw, not the best version's (biased) rate, and never wipes a running demo."""

from __future__ import annotations

import os

import pytest

from app.demo import Tally, summary


def tally(start: float, verdicts: list[bool]) -> Tally:
    """One verdict a second from `start`."""
    return Tally(served=len(verdicts), accepted=sum(verdicts), first_at=start,
                 log=[(start + i, ok) for i, ok in enumerate(verdicts)])


def test_the_last_two_minutes_and_the_time_to_forty_points():
    # v0 accepts 1 in 10 for 200 s; v1 9 in 10 for 100 s; v2, the last 100 s, 1 in 2.
    tallies = {"v0": tally(0, [i % 10 == 0 for i in range(200)]),
               "v1": tally(200, [i % 10 != 0 for i in range(100)]),
               "v2": tally(300, [i % 2 == 0 for i in range(100)])}
    result = summary(tallies)
    assert result["starter"]["accept_rate"] == pytest.approx(0.1)
    # The last 120 s (from 279 s to 399 s): 21 of v1's verdicts (19 accepted), all 100 of v2's (50).
    recent = result["last_two_minutes"]
    assert recent["served"] == 121 and recent["accept_rate"] == pytest.approx(69 / 121)
    assert recent["ci"][0] < 69 / 121 < recent["ci"][1]
    # At 200 + k s the last 100 verdicts are v0's last 99 - k and v1's first k + 1; at k = 49
    # that is 5 + 45 accepted: 0.5, the starter's 0.1 plus 40 points (at k = 48, 49).
    assert result["time_to_plus_40_s"] == 249
    assert result["best"]["version"] == "v1"  # the maximum over versions, kept for reference


def test_a_run_that_never_rose_forty_points_says_so():
    tallies = {"v0": tally(0, [i % 10 == 0 for i in range(300)])}
    assert summary(tallies)["time_to_plus_40_s"] is None


def test_a_second_demo_refuses_to_wipe_a_running_one(tmp_path, monkeypatch):
    """`liverl demo` starts by wiping its data directory; a second one started while the
    first runs must refuse, not delete the running demo's registry under it."""
    from typer.testing import CliRunner

    from app.cli import app
    from app.demo import demo_settings
    from liverl.manifest import Component, Manifest, manifest_file

    monkeypatch.setenv("LIVERL_DATA_DIR", str(tmp_path))
    settings = demo_settings()
    manifest_file(settings).parent.mkdir(parents=True)
    alive_component = Component(name="learner", pid=os.getpid(), log="learner.log")
    manifest_file(settings).write_text(Manifest(cluster_id="c", started_at=0, components=[alive_component])
                                       .model_dump_json())
    result = CliRunner().invoke(app, ["demo", "--minutes", "0.1"])
    assert result.exit_code == 1 and "already running" in result.output
    assert manifest_file(settings).exists()
