"""Delta sync and hot swaps end to end: several replicas, steady load, real versions.

    .venv/bin/python benchmarks/bench_swap.py [--replicas 2] [--minutes 4] [--users 4]

Starts the embedded stack with the demo's learner settings and N replicas, runs the
demo's simulated users against the gateway (their feedback makes the learner publish
and promote versions), then reports every swap from the policy registry: transport,
bytes fetched against the weights' size, fetch/decode time, drain (in-flight requests
finishing on the old weights), engine pause (vLLM paused
while the weights load), time out of rotation (drain + pause + verification), and the
gateway's request outcomes from ClickHouse over the whole run. Then, with the users
gone and the learner paused, swaps each replica back and forth between the stable
version and its parent: the same figures without contention.
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
from app.stack import down, drain, up, wipe_data_dir
from liverl.keys import admin_headers
from liverl.pool import read_pool
from liverl.settings import Settings
from policies.registry import Registry
from serving.swap import replace_replica

console = Console(width=160)  # the swaps table whole, also when written to a file

STATUS_SQL = "SELECT status, count() AS n FROM requests GROUP BY status ORDER BY status"


def swaps_table(registry: Registry) -> list[dict]:
    rows = []
    for version in registry.versions():
        for swap in version.metrics.get("swaps", []):
            rows.append({"version": version.version, "state": version.state, **swap})
    return rows


def steady_load(settings: Settings, population: Population, minutes: float, label: str,
                drain_learner: bool = True) -> dict[str, int]:
    """The users for `minutes`, then a drain (of the learner's backlog too, unless told not
    to); the gateway's requests by HTTP status."""
    threads = population.start()
    with Progress(console=console) as bar:
        task = bar.add_task(label, total=minutes * 60)
        while (elapsed := time.time() - population.started) < minutes * 60:
            time.sleep(1)
            bar.update(task, completed=elapsed)
    population.stop(threads)
    if not drain_learner:
        settings = settings.model_copy(update={"learner": settings.learner.model_copy(update={"enabled": False})})
    drain(settings, settings.drain_timeout_s, say=lambda _: None)
    response = httpx.post(settings.url(settings.ports.sink) + "/sql", timeout=60,
                          headers=admin_headers(settings), json={"sql": STATUS_SQL, "format": "json"})
    return {str(r["status"]): int(r["n"]) for r in json.loads(response.raise_for_status().text)["data"]}


def idle_swaps(settings: Settings, rounds: int) -> list[dict]:
    """The floor without load: learner paused, no traffic, each replica swapped between
    the stable version and its parent, `rounds` times each way, through the same code."""
    learner = settings.url(settings.ports.learner)
    httpx.post(learner + "/pause", params={"reason": "bench_swap"}, headers=admin_headers(settings),
               timeout=620).raise_for_status()
    controller = settings.url(settings.ports.controller) + "/health"
    while (health := httpx.get(controller, timeout=10).json())["canary"] or health["state"].startswith(
            ("promoting", "starting")):
        time.sleep(1)
    registry = Registry(settings.policies_dir)
    stable = registry.stable()
    if stable is None or stable.parent is None:
        return []
    parent = registry.get(stable.parent)
    reports = []
    for _ in range(rounds):
        for version in (parent, stable):
            for replica in read_pool(settings).replicas:
                report = replace_replica(settings, replica.name, version.version, Path(version.model_dir))
                reports.append({"version": version.version, **report.model_dump()})
    return reports


def summarize(swaps: list[dict]) -> dict:
    ok = [s for s in swaps if s["ok"]]
    return {"swaps": len(swaps), "swaps_ok": len(ok),
            **{f"{k}_median": statistics.median(s[k] for s in ok) for k in ("fetch_s", "decode_s", "drain_s",
                                                                            "load_s", "verify_s", "pause_s")},
            **{f"{k}_min": min(s[k] for s in ok) for k in ("load_s", "pause_s")},
            **{f"{k}_max": max(s[k] for s in ok) for k in ("drain_s", "load_s", "pause_s")}}


def main(replicas: int = 2, minutes: float = 4.0, users: int = 4, seed: int = 0, idle_rounds: int = 3) -> None:
    settings = demo_settings()
    settings.data_dir = settings.data_dir.parent / "bench-swap"
    settings.serving.replicas = replicas
    wipe_data_dir(settings)  # every run from the starter
    up(settings, say=console.print)
    try:
        keys = json.loads((settings.data_dir / "dev-keys.json").read_text())
        population = Population(settings, keys["tenant_key"], users, seed, max_tokens=32)
        statuses = steady_load(settings, population, minutes, f"steady load from {users} users")
        swaps = swaps_table(Registry(settings.policies_dir))
        idle = idle_swaps(settings, rounds=idle_rounds)
    finally:
        down(settings, say=console.print, force=True)

    table = Table(title=f"swaps under load, {replicas} replicas")
    columns = ["version", "replica", "ok", "transport", "fetched_bytes", "weights_bytes", "fetch_s",
               "decode_s", "drain_s", "load_s", "verify_s", "pause_s"]
    for c in columns:
        table.add_column(c)
    for s in swaps:
        table.add_row(*(f"{s[c]:.3f}" if isinstance(s[c], float) else str(s[c]) for c in columns))
    console.print(table)
    ok = [s for s in swaps if s["ok"]]
    if not ok:
        raise SystemExit("no version was promoted: run longer (--minutes)")
    delta = [s for s in ok if s["transport"] == "delta"]
    result = {
        "replicas": replicas, "minutes": minutes,
        "versions_on_every_replica": sum(1 for v in {s["version"] for s in ok}
                                         if sum(s["version"] == v for s in ok) == replicas),
        "request_statuses": statuses,
        "client_errors": population.errors,
        "delta_swaps": len(delta),
        "median_fetched_over_weights": statistics.median(s["fetched_bytes"] / s["weights_bytes"] for s in delta)
        if delta else None,
        "under_load": summarize(swaps),
        "idle": summarize(idle) if any(s["ok"] for s in idle) else None,
    }
    console.print_json(json.dumps(result))


if __name__ == "__main__":
    typer.run(main)
