"""Time to +40 points and the last two minutes' rate of demo runs made by code older than
the demo's own summary of them (before 44f691f, e.g. 0ae964d, the code before the guard),
from each run's summary.json: its learning curve keeps every 25th verdict's accept rate
over the last 100 verdicts, so the time to +40 is within about 25 verdicts and the last
two minutes' rate is the mean of those windows (an approximation the new summary does
not need).

    .venv/bin/python benchmarks/summarise_old_demo.py bench-learning/old-0ae964d
"""

import json
import statistics
import sys
from pathlib import Path

rows = []
for path in sorted(Path(sys.argv[1]).glob("seed-*/summary.json")):
    r = json.loads(path.read_text())
    curve, starter = r["learning_curve"], r["starter"]["accept_rate"]
    end = curve[-1][0]
    rise = next((at for at, _, rate in curve if rate >= starter + 0.4), None)
    last = [rate for at, _, rate in curve if at >= end - 120]
    rows.append((path.parent.name, starter, statistics.mean(last), rise, r["best"]["accept_rate"]))
    print(f"{path.parent.name}: starter {starter:.3f}, last two minutes ~{statistics.mean(last):.3f}, "
          f"+40 at {rise and round(rise)} s, best version {r['best']['version']} {r['best']['accept_rate']:.3f}")
rises = [r[3] for r in rows if r[3] is not None]
print(f"median +40: {statistics.median(rises) if rises else None} s ({len(rises)} of {len(rows)}); "
      f"last two minutes median ~{statistics.median(r[2] for r in rows):.3f}")
