"""Lending idle replicas to rollouts, measured: the simulated day of `liverl demo --load day`
run with the capacity scheduler on and then off, the same load pattern and seed.

Reports, against the issue's targets: take-back time (load signal to the replica serving
production again; p99 over the run's take-backs, target 2 s) and production requests failed
(target 0); production latency p99 in peaks with lending on vs off (within 10%) and while a
replica is lent vs the run's unlent periods and vs lending off over the same seconds (at
most 1.5x); harvest, rollout tokens/s over all lent time vs a lent replica alone with no
production traffic, from the same run (at least 80%). Each run's component logs (the
capacity scheduler's events, the gateway's) are kept in its folder's `run/`.

    .venv/bin/python benchmarks/bench_capacity.py --minutes 8 --day-minutes 4 --out bench-capacity
    .venv/bin/python benchmarks/bench_capacity.py --runs 3 --out bench-capacity/three   # pairs, for the spread
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from app.demo import demo_settings, p99

ROOT = Path(__file__).resolve().parents[1]
console = Console()


def demo(out: Path, minutes: float, day_minutes: float, seed: int, heldout: int, env: dict[str, str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(out / "demo.log", "w") as log:
        subprocess.run([str(ROOT / ".venv/bin/liverl"), "demo", "--load", "day", "--minutes", str(minutes),
                        "--day-minutes", str(day_minutes), "--seed", str(seed), "--heldout", str(heldout),
                        "--out", str(out)], cwd=ROOT, env=dict(os.environ, **env), stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    # Both runs of a pair use the demo's data directory: keep this run's logs beside its results.
    shutil.copytree(demo_settings(day=True).run_dir, out / "run", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("locks", "replicas", "*.lock"))
    result = json.loads((out / "summary.json").read_text())
    result["wall_s"] = time.time() - started
    return result


def latencies_within(run: Path, windows: list) -> list[float]:
    """Latencies of a run's answered production requests sent within `windows` ((start s, end s, replica))."""
    requests = json.loads((run / "requests.json").read_text())
    return [seconds for at, seconds, ok, *_ in requests if ok and any(a <= at < b for a, b, _ in windows)]


def p99_within(run: Path, windows: list) -> float | None:
    return p99(latencies_within(run, windows))


def fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.3g}{unit}"


def rows(a: dict, b: dict) -> list[tuple[str, str, str, str]]:
    lat_on, lat_off = a["latency_p99_s"], b["latency_p99_s"]
    return [
        ("take-backs (lends)", f"{a['take_backs']} ({a['lends']})", "", ""),
        ("take-back p99 / max", f"{fmt(a['take_back_s']['p99'], ' s')} / {fmt(a['take_back_s']['max'], ' s')}",
         "", "<= 2 s"),
        ("take-backs over the bound (capacity.take_back_bound_s)", str(a.get("take_backs_over_bound", "")), "",
         "0"),
        ("production requests failed", f"{a['production_failed']} of {a['production_requests']}",
         f"{b['production_failed']} of {b['production_requests']}", "0"),
        # The users' client retries (as a product's would): an answer after a retry hid a failure.
        ("... answered only after a client retry", str(a.get("production_retried", "-")),
         str(b.get("production_retried", "-")), "0"),
        ("production requests answered by a lent replica", str(a.get("production_on_lent_replica", "-")), "", "0"),
        ("latency p99 in peaks", fmt(lat_on["peak"], " s"), fmt(lat_off["peak"], " s"), "on <= 1.1x off"),
        # The policies differ (one learned from rollouts too): the same work per request, for comparison.
        ("... mean completion tokens", fmt(a.get("peak_completion_tokens")), fmt(b.get("peak_completion_tokens")), ""),
        ("... p99 of those answered at full length", fmt(lat_on.get("peak_full_length"), " s"),
         fmt(lat_off.get("peak_full_length"), " s"), ""),
        ("latency p99 lent / not lent", f"{fmt(lat_on['lent'], ' s')} / {fmt(lat_on['not_lent'], ' s')}", "",
         "<= 1.5x"),
        ("latency p99 in the lent periods' seconds", fmt(lat_on["lent"], " s"), fmt(b["p99_in_lent_periods_s"], " s"),
         "on <= 1.5x off"),
        ("rollout tokens/s lent / alone / beside production", f"{fmt(a['harvest']['tokens_per_s_lent'])} / "
         f"{fmt(a['harvest']['tokens_per_s_alone'])} / {fmt(a['harvest']['tokens_per_s_beside_production'])} "
         f"({fmt(a['harvest']['seconds_beside_production'])} s)", "", ""),
        ("harvest", fmt(a["harvest"]["share"]), "", ">= 0.8"),
        ("rollout groups (cut)", f"{a['rollout_groups']} ({a['rollout_groups_cut']})", "", ""),
    ]


def main(minutes: float = typer.Option(8.0, help="Length of each run."),
         day_minutes: float = typer.Option(4.0, help="One simulated day (two per 8-minute run)."),
         seed: int = typer.Option(0),
         runs: int = typer.Option(1, min=1, help="Pairs of runs (on, then off): peak latency varies from run "
                                  "to run on shared cores, so compare several."),
         heldout: int = typer.Option(50, help="Held-out coding tasks per evaluated version (the on runs)."),
         out: Path = typer.Option(Path("bench-capacity"))) -> None:
    pairs = []
    for run in range(runs):
        where = out if runs == 1 else out / f"run-{run}"
        on = demo(where / "lending-on", minutes, day_minutes, seed, heldout, {})
        off = demo(where / "lending-off", minutes, day_minutes, seed, 1, {"LIVERL_CAPACITY__ENABLED": "false"})
        a, b = on["day"], off["day"]
        b["p99_in_lent_periods_s"] = p99_within(where / "lending-off", a["lent"])  # the same load, nothing lent
        table = Table(title=f"lending idle replicas: {minutes} min runs, {day_minutes}-min days, seed {seed}"
                            + (f", pair {run + 1} of {runs}" if runs > 1 else ""))
        for column in ("measure", "lending on", "lending off", "target"):
            table.add_column(column)
        for row in rows(a, b):
            table.add_row(*row)
        console.print(table)
        console.print(f"held-out pass rate per version: {[(r['version'], r['pass_rate']) for r in a['heldout']]}")
        (where / "result.json").write_text(json.dumps({"on": a, "off": b}, indent=2))
        pairs.append((a, b))
    if runs > 1:
        slowest = [a["take_back_s"]["max"] for a, _ in pairs if a["take_back_s"]["max"] is not None]
        for measure, name in (("peak", "peak p99"), ("peak_full_length", "peak p99 at full length")):
            ratios = [a["latency_p99_s"][measure] / b["latency_p99_s"][measure] for a, b in pairs
                      if a["latency_p99_s"].get(measure) and b["latency_p99_s"].get(measure)]
            console.print(f"{name} on / off per pair: {[round(r, 3) for r in ratios]}, median "
                          f"{statistics.median(ratios):.3f}" if ratios else f"no {name} in any pair")
        lent = [a["latency_p99_s"]["lent"] / b["p99_in_lent_periods_s"] for a, b in pairs
                if a["latency_p99_s"]["lent"] and b["p99_in_lent_periods_s"]]
        console.print(f"p99 in the lent periods, on / off over the same seconds, per pair: "
                      f"{[round(r, 3) for r in lent]}" if lent else "nothing lent in any pair")
        console.print(f"take-backs over all pairs: {sum(a['take_backs'] for a, _ in pairs)}, slowest per pair "
                      f"{[round(x, 2) for x in slowest]} s")


if __name__ == "__main__":
    typer.run(main)
