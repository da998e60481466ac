"""How long a replica takes to start, and that it serves its own weights when it starts fast.

Starts one replica at a time on each version directory given (copied first, so every start
is of a path vLLM never saw), waits until it has answered its first request as the gateway
asks them, then checks the version's probe (`serving.swap.verify`: the served logprobs are
the version's own) and stops it. `--aot-compile` starts them with vLLM's AOT compile
artifacts on (`serving.aot_compile`, the code before), for the comparison.

    .venv/bin/python benchmarks/bench_replica_start.py DIR [DIR ...] [--aot-compile]
"""

from __future__ import annotations

import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from liverl.process import stop_pid
from liverl.settings import ServingConfig, Settings
from serving.replicas import launch_replica, replica_url, wait_replica
from serving.swap import verify

console = Console()
ENGINE_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")


def start(model_dir: Path, root: Path, aot_compile: bool) -> dict:
    """One replica of a copy of `model_dir`: its start's seconds, its engine's, and the probe."""
    data = Path(tempfile.mkdtemp(dir=root))
    model = data / "model"
    shutil.copytree(model_dir, model)
    settings = Settings(data_dir=data, serving=ServingConfig(replicas=1, kv_cache_gib=1, aot_compile=aot_compile))
    began = time.perf_counter()
    replica, process = launch_replica(settings, "replica-0", model, replica_url(settings, 0), "v")
    try:
        wait_replica(settings, replica, process)
        seconds = time.perf_counter() - began
        verify(replica.url, model, settings.learner.probe_tolerance)
    finally:
        stop_pid(process.pid, timeout=60)
    log = (settings.run_dir / "replica-0-v.log").read_text()
    engine = ENGINE_INIT.search(log)
    return {"version": model_dir.name, "seconds": seconds, "engine_s": float(engine.group(1)) if engine else None}


def main(versions: list[Path] = typer.Argument(..., help="Version directories (a model each)."),
         aot_compile: bool = typer.Option(False, help="Start with vLLM's AOT compile artifacts on (the code "
                                                      "before), for the comparison.")) -> None:
    with tempfile.TemporaryDirectory(prefix="replica-start-") as root:
        rows = [start(version, Path(root), aot_compile) for version in versions]
    table = Table(title=f"replica starts, one at a time (AOT compile {'on' if aot_compile else 'off'})")
    for column in ("version", "start to first answer, s", "engine init, s", "probe"):
        table.add_column(column, justify="right")
    for row in rows:
        engine = "-" if row["engine_s"] is None else f"{row['engine_s']:.1f}"  # a vLLM whose log says otherwise
        table.add_row(row["version"], f"{row['seconds']:.1f}", engine, "verified")
    console.print(table)
    console.print(f"median start {statistics.median(r['seconds'] for r in rows):.1f} s "
                  f"({min(r['seconds'] for r in rows):.1f}-{max(r['seconds'] for r in rows):.1f})")


if __name__ == "__main__":
    typer.run(main)
