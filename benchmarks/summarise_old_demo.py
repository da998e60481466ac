"""Time to +40 points and the last two minutes' rate of demo runs made by code older than
the demo's own summary of them (before 44f691f, e.g. 0ae964d, the code before the guard),
from each run's summary.json: its learning curve keeps every 25th verdict's accept rate
over the last 100 verdicts, so the time to +40 is within about 25 verdicts and the last
two minutes' rate is the mean of those windows (an approximation the new summary does
not need). Stable regressions are counted as the demo counts them today
(`app.demo.regressions`) on the run's ClickHouse figures per version: that code swapped
every version that passed its gate into its one replica, so each served version replaced
the one served before it. With `--against`, folders of today's runs (`seed-N/summary.json`, as
`bench_learning.py` writes them) are drawn beside the old runs, seed by seed.

    .venv/bin/python benchmarks/summarise_old_demo.py bench-learning/old-0ae964d
    .venv/bin/python benchmarks/summarise_old_demo.py bench-learning/old-0ae964d-tied \\
        --against bench-learning/tie40k-seed0-nov26 --against bench-learning/tie40k-seeds1-4-nov26 \\
        --plot docs/learning-old-vs-guard-tied-starter-nov26.png
"""

import json
import statistics
from pathlib import Path

import typer

from app.demo import regressions


def curves(folder: Path) -> dict[str, list]:
    return {path.parent.name: json.loads(path.read_text())["learning_curve"]
            for path in sorted(folder.glob("seed-*/summary.json"))}


def plot(old: dict[str, list], new: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for i, seed in enumerate(sorted(old | new)):
        colour = f"C{i}"
        if seed in old:
            ax.plot([c[0] for c in old[seed]], [c[2] for c in old[seed]], color=colour, linestyle="--",
                    linewidth=1, label=f"{seed}, before the guard")
        if seed in new:
            ax.plot([c[0] for c in new[seed]], [c[2] for c in new[seed]], color=colour, linewidth=1.5,
                    label=f"{seed}, with the guard")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("accept rate (last 100 verdicts)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(folder: Path = typer.Argument(..., help="The old code's runs: seed-N/summary.json."),
         against: list[Path] = typer.Option([], help="Folders of today's runs to draw beside them."),
         plot_to: Path | None = typer.Option(None, "--plot", help="Where the plot goes (with --against).")) -> None:
    rows = []
    for path in sorted(folder.glob("seed-*/summary.json")):
        r = json.loads(path.read_text())
        curve, starter = r["learning_curve"], r["starter"]["accept_rate"]
        end = curve[-1][0]
        rise = next((at for at, _, rate in curve if rate >= starter + 0.4), None)
        last = [rate for at, _, rate in curve if at >= end - 120]
        rows.append((path.parent.name, starter, statistics.mean(last), rise, r["best"]["accept_rate"]))
        per_version = [row for row in r["clickhouse"] if row["n"]]
        worse = regressions(sorted((row["policy_version"] for row in per_version), key=lambda v: int(v[1:])),
                            per_version)
        print(f"{path.parent.name}: starter {starter:.3f}, last two minutes ~{statistics.mean(last):.3f}, "
              f"+40 at {rise and round(rise)} s, best version {r['best']['version']} {r['best']['accept_rate']:.3f}, "
              f"stable regressions {len(worse)}"
              + "".join(f"\n    {w['version']} {w['accept_rate']:.3f} (upper {w['upper']:.3f}, n {w['served']}) "
                        f"replaced {w['replaced']} {w['replaced_rate']:.3f}" for w in worse))
    rises = [r[3] for r in rows if r[3] is not None]
    print(f"median +40: {statistics.median(rises) if rises else None} s ({len(rises)} of {len(rows)}); "
          f"last two minutes median ~{statistics.median(r[2] for r in rows):.3f}")
    if plot_to is not None:
        new: dict[str, list] = {}
        for other in against:
            new |= curves(other)
        plot(curves(folder), new, plot_to)
        print(f"plot: {plot_to}")


if __name__ == "__main__":
    typer.run(main)
