"""How far two runs of the same day differ when nothing differs: the latency comparisons
of `bench_capacity.py` (lending on against off) applied to lending off against lending off.

Reads pairs that `bench_capacity.py` wrote (each a folder with `lending-on/` and
`lending-off/`, the same seed and day) and compares every two lending-off runs: p99 in
peaks, and p99 over the seconds each lending-on run had a replica lent, each as the
higher over the lower. A ratio of lending on to off is only evidence of lending's cost
where it lies outside these. Then lending on against off over the lent seconds of all the
pairs together: one pair's lent seconds hold 5-20 production requests (the first of a
morning, sent while the take-back runs), so its p99 is its slowest request; together they
hold more.

    .venv/bin/python benchmarks/bench_capacity_noise.py bench-capacity/first-request-nov27/run-*
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import typer
from bench_capacity import latencies_within, p99_within
from rich.console import Console
from rich.table import Table

from app.demo import p99

console = Console()


def apart(x: float, y: float) -> float:
    return max(x, y) / min(x, y)


def spread(ratios: list[float], target: float) -> str:
    over = sum(r > target for r in ratios)
    return (f"median {statistics.median(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f}x, "
            f"{over} of {len(ratios)} over {target}x")


def main(pairs: list[Path] = typer.Argument(..., help="Folders bench_capacity.py wrote, each with lending-on/ "
                                            "and lending-off/ (the same seed, day and code).")) -> None:
    offs = [pair / "lending-off" for pair in pairs]
    summaries = {run: json.loads((run / "summary.json").read_text())["day"] for run in offs}
    lends = [json.loads((pair / "lending-on" / "summary.json").read_text())["day"]["lent"] for pair in pairs]
    table = Table(title=f"lending off against lending off: {len(offs)} runs")
    for column in ("runs", "p99 in peaks", "apart", "p99 in each on run's lent seconds", "apart"):
        table.add_column(column)
    peak_ratios, lent_ratios = [], []
    for a, b in itertools.combinations(offs, 2):
        peak_a, peak_b = summaries[a]["latency_p99_s"]["peak"], summaries[b]["latency_p99_s"]["peak"]
        peak_ratios.append(apart(peak_a, peak_b))
        lent = [(x, y) for x, y in ((p99_within(a, windows), p99_within(b, windows)) for windows in lends) if x and y]
        lent_ratios += [apart(x, y) for x, y in lent]
        table.add_row(f"{a.parent} / {b.parent}", f"{peak_a:.3f} / {peak_b:.3f} s", f"{apart(peak_a, peak_b):.2f}x",
                      ", ".join(f"{x:.3f} / {y:.3f}" for x, y in lent),
                      ", ".join(f"{apart(x, y):.2f}x" for x, y in lent))
    console.print(table)
    console.print(f"p99 in peaks, off / off: {spread(peak_ratios, 1.1)}")
    if lent_ratios:
        console.print(f"p99 in lent seconds, off / off: {spread(lent_ratios, 1.5)}")
    on = [x for pair, windows in zip(pairs, lends, strict=True)
          for x in latencies_within(pair / "lending-on", windows)]
    off = [x for pair, windows in zip(pairs, lends, strict=True)
           for x in latencies_within(pair / "lending-off", windows)]
    if on and off:
        console.print(f"lent seconds of all {len(pairs)} pairs together, on / off: p99 {p99(on):.3f} / "
                      f"{p99(off):.3f} s ({p99(on) / p99(off):.2f}x), median {statistics.median(on):.3f} / "
                      f"{statistics.median(off):.3f} s ({statistics.median(on) / statistics.median(off):.2f}x), "
                      f"{len(on)} / {len(off)} requests")


if __name__ == "__main__":
    typer.run(main)
