"""The in-place swap's commit, step by step, on a replica under steady load.

    .venv/bin/python benchmarks/bench_commit.py [--rounds 30] [--executor uni|mp] [--users 4]

Starts the embedded stack with two replicas and the learner paused (no new versions,
no training competing for the cores), runs the demo's simulated users against the
gateway, and commits replica-0's own weights into it `--rounds` times, a few seconds
apart, exactly as a swap does (`serving.swap`: out of rotation, drain, then
`load_in_place`). Reports each step of the commit: vLLM `/pause`, the load RPC (and the
load as timed inside the worker), `/reset_prefix_cache`, `/resume`; their sum is the
serving pause. `--executor` picks vLLM's executor for the replicas
(`serving.executor`), to compare them on the same load.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from app.demo import Population, demo_settings
from app.stack import down, up, wipe_data_dir
from liverl.keys import admin_headers
from liverl.pool import read_pool, replica_lock, set_replica
from liverl.settings import ServingConfig
from serving.swap import drain_in_flight, load_in_place

console = Console(width=160)
STEPS = ("pause", "load", "worker_load", "reset", "resume")


def main(rounds: int = 30, executor: str = "uni", users: int = 4, seed: int = 0, gap_s: float = 3.0) -> None:
    settings = demo_settings()
    settings.data_dir = settings.data_dir.parent / "bench-commit"
    settings.serving = ServingConfig.model_validate({**settings.serving.model_dump(), "replicas": 2,
                                                     "executor": executor})
    wipe_data_dir(settings)  # every run from the starter
    up(settings, say=console.print)
    commits = []
    try:
        httpx.post(settings.url(settings.ports.learner) + "/pause", params={"reason": "bench_commit"},
                   headers=admin_headers(settings), timeout=10).raise_for_status()
        keys = json.loads((settings.data_dir / "dev-keys.json").read_text())
        population = Population(settings, keys["tenant_key"], users, seed, max_tokens=32)
        threads = population.start()
        time.sleep(10)  # the users' first requests in flight on both replicas
        replica = read_pool(settings).replicas[0]
        with Progress(console=console) as bar:
            task = bar.add_task(f"commits on {replica.name} under load from {users} users", total=rounds)
            for _ in range(rounds):
                with replica_lock(settings, replica.name):  # or the controller puts it back mid-commit
                    set_replica(settings, replica.name, enabled=False)
                    drain = drain_in_flight(replica.url, settings.serving.swap_drain_s)
                    steps = load_in_place(replica.url, Path(replica.model_dir))
                    set_replica(settings, replica.name, enabled=True)
                commits.append({"drain": drain, **steps,
                                "serving_pause": sum(steps[s] for s in STEPS if s != "worker_load")})
                bar.advance(task)
                time.sleep(gap_s)
        population.stop(threads)
    finally:
        down(settings, say=console.print, force=True)

    table = Table(title=f"commit steps (s), executor {executor}, {rounds} commits under load")
    for column in ("step", "median", "p90", "max"):
        table.add_column(column)
    summary = {}
    for step in ("drain", *STEPS, "serving_pause"):
        values = sorted(c[step] for c in commits)
        summary[step] = {"median": statistics.median(values), "p90": values[int(0.9 * (len(values) - 1))],
                         "max": values[-1]}
        table.add_row(step, *(f"{summary[step][k]:.3f}" for k in ("median", "p90", "max")))
    console.print(table)
    pauses = [c["serving_pause"] for c in commits]
    console.print_json(json.dumps({"executor": executor, "rounds": rounds, "users": users,
                                   "under_1s": sum(p < 1.0 for p in pauses), "steps": summary,
                                   "serving_pause_sorted": [round(p, 3) for p in sorted(pauses)]}))


if __name__ == "__main__":
    typer.run(main)
