"""Every day run on record, production against skill (issue 46): how often one run meets each of
the benchmark's two per-run figures (production accept in the last two minutes at 0.90 or more; the
last stable 5 points or more above the starter), and both; and what the runs that keep production
fast have in common (the stables they went through, the candidates held for skill).

Reads the per-seed rows `benchmarks/bench_day_skill.py` wrote (`runs.json`, or one file a seed),
every arm and every machine together, and plots each run as a point: production's figure against
the skill's, the target lines drawn.

    .venv/bin/python benchmarks/day_runs.py --plot docs/day-runs.png
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

PRODUCTION_TARGET = 0.90
GAIN_TARGET = 5.0  # points above the starter


def runs_in(paths: list[Path]) -> list[dict]:
    """Each run's row, with the file it came from as `arm` (its folder, and the file's name
    when a folder holds several arms)."""
    rows = []
    for path in sorted(paths):
        data = json.loads(path.read_text())
        for run in data if isinstance(data, list) else [data]:
            if "last_2_min" in run and "gain_points" in run:
                rows.append(run | {"arm": f"{path.parent.name.removeprefix('day-skill-')}/{path.stem}"})
    return rows


def main(results: list[Path] = typer.Argument(None, help="Result files; default: every "
                                              "benchmarks/results/day-skill-*/*.json."),
         plot: Path | None = typer.Option(None, help="Where to draw production against skill, a point a run.")
         ) -> None:
    root = Path(__file__).parent / "results"
    runs = runs_in(results or list(root.glob("day-skill-*/*.json")))
    fast = [r for r in runs if r["last_2_min"] >= PRODUCTION_TARGET]
    skilled = [r for r in runs if r["gain_points"] >= GAIN_TARGET - 1e-9]
    both = [r for r in fast if r["gain_points"] >= GAIN_TARGET - 1e-9]
    console = Console()
    console.print(f"{len(runs)} runs: production at {PRODUCTION_TARGET:.2f} or more in {len(fast)}, the last "
                  f"stable +{GAIN_TARGET:.0f} points or more in {len(skilled)}, both in {len(both)}")
    for r in both:
        console.print(f"  both: {r['arm']} seed {r['seed']}: {r['last_2_min']:.3f}, {r['gain_points']:+.1f} points")

    table = Table("stables", "runs", "production: median", f"at {PRODUCTION_TARGET:.2f}", "points: median",
                  f"+{GAIN_TARGET:.0f} or more", "held for skill: median")
    for low, high in ((0, 5), (5, 9), (9, 13), (13, 100)):
        bucket = [r for r in runs if low <= r["stables"] < high]
        if bucket:
            table.add_row(f"{low}-{high - 1}" if high < 100 else f"{low}+", str(len(bucket)),
                          f"{statistics.median(r['last_2_min'] for r in bucket):.3f}",
                          str(sum(r["last_2_min"] >= PRODUCTION_TARGET for r in bucket)),
                          f"{statistics.median(r['gain_points'] for r in bucket):+.1f}",
                          str(sum(r["gain_points"] >= GAIN_TARGET - 1e-9 for r in bucket)),
                          f"{statistics.median(r['held_for_skill'] for r in bucket):g}")
    console.print(table)
    if plot:
        draw(runs, plot)
        console.print(f"plot: {plot}")


def draw(runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    points = ax.scatter([r["gain_points"] for r in runs], [r["last_2_min"] for r in runs],
                        c=[r["stables"] for r in runs], cmap="viridis", s=28, edgecolors="black", linewidths=0.4)
    fig.colorbar(points, label="stable versions in the run")
    ax.axhline(PRODUCTION_TARGET, color="firebrick", linestyle="--", linewidth=1)
    ax.axvline(GAIN_TARGET, color="firebrick", linestyle="--", linewidth=1)
    ax.set_xlabel("last stable's held-out pass rate against the starter's (points)")
    ax.set_ylabel("production accept, last two minutes")
    ax.set_title(f"{len(runs)} day runs (8 min, 4-min days): both targets are the upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    typer.run(main)
