"""The main job over several seeds: does every run learn, how fast, and did any user get
a stable version clearly worse than the one it replaced?

Runs `liverl demo` once per seed, one after the other (each on a fresh embedded stack,
from the starter policy), with any `--set VAR=VALUE` settings in its environment (e.g.
`--set LIVERL_LEARNER__OBJECTIVE=ppo` for the objective ablation), keeps each run's
summary.json, prints a table (each run, the median and the range) and plots every run's
learning curve on one figure.

    .venv/bin/python benchmarks/bench_learning.py --seeds 0 --seeds 1 --seeds 2 --seeds 3 --seeds 4 \
        --minutes 10 --out bench-learning/guard
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
console = Console()


def run(seed: int, minutes: float, out: Path, env: dict[str, str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(out / "demo.log", "w") as log:
        subprocess.run([str(ROOT / ".venv/bin/liverl"), "demo", "--minutes", str(minutes), "--seed", str(seed),
                        "--out", str(out)], cwd=ROOT, env=dict(os.environ, **env), stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    result = json.loads((out / "summary.json").read_text())
    result["wall_s"] = time.time() - started
    return result


def row(seed: int, r: dict) -> dict:
    last = r["last_two_minutes"]
    return {"seed": seed, "starter": r["starter"]["accept_rate"], "last_2_min": last["accept_rate"],
            "last_2_min_ci": last["ci"], "time_to_plus_40_s": r["time_to_plus_40_s"],
            "guard_stopped": len(r.get("guard", [])), "stable_regressions": len(r.get("stable_regressions", [])),
            "versions": len(r["clickhouse"])}


def plot(results: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for seed, r in results.items():
        curve = r["learning_curve"]
        ax.plot([c[0] for c in curve], [c[2] for c in curve], label=f"seed {seed}")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("accept rate (last 100 verdicts)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(seeds: list[int] = typer.Option([0, 1, 2, 3, 4], help="One demo run per seed."),
         minutes: float = typer.Option(10.0, help="Each run's simulated traffic."),
         out: Path = typer.Option(Path("bench-learning/run"), help="Where each run's output goes."),
         set_: list[str] = typer.Option([], "--set", help="VAR=VALUE settings for every run.")) -> None:
    env = dict(item.split("=", 1) for item in set_)
    results = {}
    for seed in seeds:
        console.print(f"seed {seed}: liverl demo --minutes {minutes} {' '.join(set_)}")
        results[seed] = run(seed, minutes, out / f"seed-{seed}", env)
        console.print(row(seed, results[seed]))
    rows = [row(seed, r) for seed, r in results.items()]
    table = Table(title=f"liverl demo, {minutes} min per run {' '.join(set_)}")
    for column in rows[0]:
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()))
    console.print(table)
    last = [r["last_2_min"] for r in rows]
    rises = [r["time_to_plus_40_s"] for r in rows if r["time_to_plus_40_s"] is not None]
    console.print(f"last two minutes: median {statistics.median(last):.3f}, range {min(last):.3f}-{max(last):.3f}; "
                  f"time to +40 points: median {statistics.median(rises) if rises else None} s "
                  f"({len(rises)} of {len(rows)} runs got there)")
    (out / "runs.json").write_text(json.dumps(rows, indent=2))
    plot(results, out / "curves.png")
    (out / "report.md").write_text(report(rows, minutes, set_))
    console.print(f"plot: {out / 'curves.png'}; table for docs/benchmarks.md: {out / 'report.md'}")


def report(rows: list[dict], minutes: float, set_: list[str]) -> str:
    """The runs as a markdown table, with the command, the machine and the date."""
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    seeds = " ".join(f"--seeds {r['seed']}" for r in rows)
    lines = [f"`.venv/bin/python benchmarks/bench_learning.py {seeds} --minutes {minutes:g}"
             + "".join(f" --set {s}" for s in set_) + "`",
             "", f"{time.strftime('%a %b %d %H:%M UTC %Y', time.gmtime())}; {cpu}, {os.cpu_count()} CPUs", "",
             "| seed | starter | last two minutes (95% CI) | +40 points at | versions served "
             "| stopped by the guard | stable regressions |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lo, hi = r["last_2_min_ci"]
        rise = f"{r['time_to_plus_40_s']:.0f} s" if r["time_to_plus_40_s"] is not None else "not reached"
        lines.append(f"| {r['seed']} | {r['starter']:.3f} | {r['last_2_min']:.3f} [{lo:.3f}, {hi:.3f}] | {rise} | "
                     f"{r['versions']} | {r['guard_stopped']} | {r['stable_regressions']} |")
    last = [r["last_2_min"] for r in rows]
    rises = [r["time_to_plus_40_s"] for r in rows if r["time_to_plus_40_s"] is not None]
    lines += ["", f"Last two minutes: median {statistics.median(last):.3f}, range {min(last):.3f}-{max(last):.3f}. "
              f"+40 points: {len(rises)} of {len(rows)} runs"
              + (f", median {statistics.median(rises):.0f} s" if rises else "") + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    typer.run(main)
