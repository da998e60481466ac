"""Canaries that stood down "for want of production traffic" in runs of the day, and the
requests users were served in the `promotion.quiet_canary_s` before each (issue 46; read
from the run's own settings).

Reads each seed's registry (the stand-downs) and its ClickHouse `requests` table (complete
once the run is over: a record the broker did not take at the time is re-published from
the gateway's outbox). A stand-down with requests in that window happened while users were
served: the controller judged quiet from figures that lagged. One chdb process per seed
(chdb opens one data directory per process), each on a copy so the run's own is untouched.

    .venv/bin/python benchmarks/day_standdowns.py .liverl/bench-day-skill/quiet-live
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from policies.registry import Registry

QUERY = """
import json, sys
from chdb import session
windows = json.loads(sys.argv[2])
warehouse = session.Session(sys.argv[1])
print(json.dumps([int(warehouse.query(
    f"SELECT count() FROM liverl.requests FINAL WHERE timestamp >= toDateTime64({start}, 3) "
    f"AND timestamp < toDateTime64({end}, 3)", "CSV").data().strip()) for start, end in windows]))
"""


def served_in(chdb_dir: Path, windows: list[tuple[float, float]]) -> list[int]:
    """Requests stored with a timestamp in each (start, end) window, epoch seconds."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "chdb"
        shutil.copytree(chdb_dir, copy, symlinks=True)  # chdb's metadata links into its store
        out = subprocess.run([sys.executable, "-c", QUERY, str(copy), json.dumps(windows)],
                             capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(data_dir: Path = typer.Argument(..., help="bench_day_skill.py's --data-dir: seed-N/demo under it.")) -> None:
    table = Table(title=f"canaries stood down for want of traffic, {data_dir}")
    for column in ("seed", "stood down", "with users served", "requests in the window before each"):
        table.add_column(column, justify="right")
    for demo in sorted(data_dir.glob("seed-*/demo")):
        quiet_s = json.loads((demo / "run" / "settings.json").read_text())["promotion"]["quiet_canary_s"]
        downs = [e for e in Registry(demo / "policies").history()
                 if (e["reason"] or "").startswith("no production traffic")]
        served = served_in(demo / "chdb", [(e["at"] - quiet_s, e["at"]) for e in downs]) if downs else []
        table.add_row(demo.parent.name.removeprefix("seed-"), str(len(downs)), str(sum(n > 0 for n in served)),
                      " ".join(f"{e['version']}:{n}" for e, n in zip(downs, served, strict=True)))
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
