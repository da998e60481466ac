"""What a lent replica can harvest beside production on this machine, with nothing else running.

    .venv/bin/python benchmarks/bench_harvest.py --runs 3 --out bench-harvest

Two replicas of the starter and no stack: replica A is lent (the rollout worker's own
sampling and sandbox scoring, from a process of its own session as the worker is, the
demo's day settings: coding levels 1-2, groups of 8, `groups_in_flight` groups at once,
nothing published), replica B serves production (`--users` simulated users' requests
straight to the replica, one after another, as the demo's users send them). Three phases
per run: rollouts alone, production alone, both. Reports A's rollout tokens/s beside
production against alone (the issue's harvest, with every other component of the stack
taken out) and B's latency beside rollouts against alone, with the cores the machine was
busy. `--no-score` samples without scoring: the replicas' own contention.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path

import psutil
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from app.demo import USER_MAX_TOKENS, demo_settings, make_prompt, p99
from liverl.pool import SERVED_MODEL_NAME, replica_async_client
from liverl.settings import Settings
from policies.starter import build_starter_policy
from rollouts.worker import RolloutWorker
from serving.replicas import launch_replica, replica_url, wait_replica

ROOT = Path(__file__).resolve().parents[1]

console = Console(width=160)  # the table whole, also when written to a file
app = typer.Typer(add_completion=False)
WARM_S = 5.0  # each phase starts measuring once its load has run this long


async def measured(loops: list[Coroutine], measuring: asyncio.Event, seconds: float) -> None:
    """Runs `loops` for WARM_S, then sets `measuring` and stops them `seconds` later."""
    running = [asyncio.create_task(loop) for loop in loops]
    await asyncio.sleep(WARM_S)
    measuring.set()
    await asyncio.sleep(seconds)
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


async def rollouts(settings: Settings, url: str, seconds: float, score: bool) -> dict:
    """The worker's groups on `url` for WARM_S + `seconds`: tokens and groups in the last `seconds`."""
    worker = RolloutWorker(settings, seed=0)
    counted = {"tokens": 0, "groups": 0, "completions": 0, "programs": 0}
    measuring = asyncio.Event()

    async def one_at_a_time(client) -> None:
        while True:
            task = next(worker.tasks)
            attempts = await worker.sample(client, task)
            if attempts is None:
                raise RuntimeError(f"a group on {url} did not complete")
            if score:
                await worker.score(task, attempts)
            if measuring.is_set():
                counted["tokens"] += sum(a.tokens for a in attempts)
                counted["groups"] += 1
                counted["completions"] += len(attempts)
                counted["programs"] += len({worker.environment.scored_as(task, a.text) for a in attempts})

    async with replica_async_client(url, settings.serving.request_timeout_s) as client:
        await measured([one_at_a_time(client) for _ in range(settings.rollouts.groups_in_flight)], measuring, seconds)
    return {"tokens_per_s": counted["tokens"] / seconds, "groups_per_s": counted["groups"] / seconds,
            "distinct_programs": counted["programs"] / max(1, counted["completions"])}


async def production(url: str, users: int, seconds: float, timeout_s: float) -> dict:
    """`users` demo users asking replica `url` one request after another: latencies of the last `seconds`."""
    latencies: list[float] = []
    measuring = asyncio.Event()

    async def user(client, seed: int) -> None:
        rng = random.Random(seed)
        while True:
            sent = time.perf_counter()
            response = await client.post("/v1/completions", json={
                "model": SERVED_MODEL_NAME, "prompt": make_prompt(rng), "max_tokens": USER_MAX_TOKENS,
                "temperature": 1.0, "seed": rng.randrange(2**31)})
            response.raise_for_status()
            if measuring.is_set():
                latencies.append(time.perf_counter() - sent)

    async with replica_async_client(url, timeout_s) as client:
        await measured([user(client, seed) for seed in range(users)], measuring, seconds)
    return {"requests_per_s": len(latencies) / seconds, "p50_s": statistics.median(latencies),
            "p99_s": p99(latencies)}


def phase(settings: Settings, urls: list[str], lent: bool, served: bool, seconds: float, users: int,
          score: bool) -> dict:
    """One phase: rollouts on A (a child process in a session of its own, as the worker
    runs) and/or production on B, measured over the same `seconds`."""
    child = subprocess.Popen(
        [sys.executable, __file__, "--rollouts-on", urls[0], "--seconds", str(seconds),
         "--score" if score else "--no-score"],
        stdout=subprocess.PIPE, cwd=ROOT, start_new_session=True) if lent else None
    psutil.cpu_percent()
    result = asyncio.run(production(urls[1], users, seconds, settings.serving.request_timeout_s)) if served else {}
    if child is not None:
        out, _ = child.communicate()
        if child.returncode != 0:
            raise RuntimeError("the rollout side failed (its error is above)")
        result |= json.loads(out)
    elif not served:
        time.sleep(WARM_S + seconds)
    return result | {"busy_cores": psutil.cpu_percent() * psutil.cpu_count() / 100}


@app.command()
def main(runs: int = typer.Option(3, help="Runs of the three phases, for the spread."),
         seconds: float = typer.Option(30.0, help="Seconds each phase is measured."),
         users: int = typer.Option(1, help="Production users on replica B (the night shift is one)."),
         score: bool = typer.Option(True, help="Score each group in the sandbox, as the worker does."),
         out: Path = typer.Option(Path("bench-harvest"), help="Where results.json goes."),
         rollouts_on: str | None = typer.Option(None, hidden=True,
                                                help="Run only the rollout side, on this replica.")) -> None:
    settings = demo_settings(day=True)
    if rollouts_on is not None:  # the phase's child process
        print(json.dumps(asyncio.run(rollouts(settings, rollouts_on, seconds, score))))
        return
    model = settings.starter.model_dir or build_starter_policy(settings.starter.cache_dir, seed=settings.starter.seed)
    launched = [launch_replica(settings, f"replica-{i}", model, replica_url(settings, i), "v0") for i in range(2)]
    results = []
    try:
        for replica, process in launched:
            wait_replica(settings, replica, process)
        urls = [replica.url for replica, _ in launched]
        phases = {"rollouts alone": (True, False), "production alone": (False, True), "both": (True, True)}
        with Progress(console=console) as progress:
            bar = progress.add_task("phases", total=runs * len(phases))
            for run in range(runs):
                by_phase = {}
                for name, (lent, served) in phases.items():
                    progress.update(bar, description=f"run {run + 1}: {name}")
                    by_phase[name] = phase(settings, urls, lent, served, seconds, users, score)
                    progress.advance(bar)
                both, alone = by_phase["both"], by_phase["rollouts alone"]
                by_phase["harvest"] = both["tokens_per_s"] / alone["tokens_per_s"]
                by_phase["p99_beside_rollouts"] = both["p99_s"] / by_phase["production alone"]["p99_s"]
                results.append(by_phase)
    finally:
        for _, process in launched:
            os.killpg(process.pid, 9)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"users": users, "score": score, "seconds": seconds,
                                                  "groups_in_flight": settings.rollouts.groups_in_flight,
                                                  "runs": results}, indent=2))
    table = Table(title=f"replica A lent, B serving {users} user(s); {seconds:.0f} s per phase")
    for column in ("run", "rollout tokens/s alone", "beside production", "harvest", "production p99 alone",
                   "beside rollouts", "ratio", "requests/s alone / beside", "busy cores (both)",
                   "distinct programs"):
        table.add_column(column, justify="right")
    for i, r in enumerate(results, 1):
        a, p, b = r["rollouts alone"], r["production alone"], r["both"]
        table.add_row(str(i), f"{a['tokens_per_s']:.0f}", f"{b['tokens_per_s']:.0f}", f"{r['harvest']:.2f}",
                      f"{p['p99_s'] * 1000:.0f} ms", f"{b['p99_s'] * 1000:.0f} ms", f"{r['p99_beside_rollouts']:.2f}x",
                      f"{p['requests_per_s']:.1f} / {b['requests_per_s']:.1f}", f"{b['busy_cores']:.2f}",
                      f"{a['distinct_programs']:.2f}")
    if len(results) > 1:
        harvests = [r["harvest"] for r in results]
        ratios = [r["p99_beside_rollouts"] for r in results]
        table.add_row("median", "", "", f"{statistics.median(harvests):.2f}", "", "",
                      f"{statistics.median(ratios):.2f}x", "", "", "")
    console.print(table)


if __name__ == "__main__":
    app()
