"""What the gateway costs serving: the same completions sent to a replica directly and
through the gateway, in alternating rounds of one run.

    .venv/bin/python benchmarks/bench_gateway.py --rounds 3

Starts the embedded stack with one replica and the learner off (`--data-dir`, ports moved
by `--port-offset`), or measures the stack already running there (`--running`). Each
round sends `--requests` completions of exactly `--max-tokens` tokens (`ignore_eos`) from
`--concurrency` clients to the replica, then to the gateway (the order flips every round,
so neither always goes first). The replica is sent the body the gateway would forward
(token ids and the sampled logprobs asked for), so the difference is the gateway's own
cost: validating, routing, relaying and recording. Reports requests/s and latency p50 and
p99 of each, and the CPU the gateway process used (its share of a core, and per request).
With `--replica-cpus 0 --other-cpus 1` the replica has a core nothing else runs on, as an
engine on an accelerator of its own has: what is left is the gateway's own cost to a request.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import typer
from rich.console import Console
from rich.table import Table

from app.demo import make_prompt
from app.stack import down, up
from liverl.manifest import read_manifest, running_settings
from liverl.pool import SERVED_MODEL_NAME, UNIX, read_pool
from liverl.settings import (
    EmbeddedBroker,
    LearnerConfig,
    PortsConfig,
    ServingConfig,
    Settings,
)
from serving.gateway import upstream_body

console = Console(width=150)


@dataclass
class Round:
    """One target's share of one round."""

    target: str
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    gateway_cpu_s: float = 0.0
    downstream_cpu_s: float = 0.0  # the broker's, the feedback stream's and the sink's

    @property
    def per_s(self) -> float:
        return len(self.latencies) / self.seconds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def bench_settings(data_dir: Path, offset: int, replica_cpus: list[int] | None) -> Settings:
    """One replica (on `replica_cpus` only, if given), the learner off, every port moved by
    `offset` (as the test suite's)."""
    return Settings(
        data_dir=data_dir,
        ports=PortsConfig().shifted(10_000 + offset),
        broker=EmbeddedBroker(port=29092 + offset),
        serving=ServingConfig(replicas=1, replica_cpus=[replica_cpus] if replica_cpus else None),
        learner=LearnerConfig(enabled=False),
    )


def session(url: str, key: str | None) -> aiohttp.ClientSession:
    # aiohttp (C HTTP parser) rather than httpx: the client shares the two cores with what it measures.
    # An idle connection is dropped before the server's keep-alive (uvicorn's 5 s) closes it:
    # rounds of the other target in between once outlasted it, and a POST on the closing
    # connection failed ("Cannot write to closing transport").
    if url.startswith(UNIX):
        connector: aiohttp.BaseConnector = aiohttp.UnixConnector(path=url[len(UNIX):], limit=0,
                                                                 keepalive_timeout=2)
        url = "http://replica"
    else:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return aiohttp.ClientSession(url, connector=connector, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=120))


async def send_all(http: aiohttp.ClientSession, bodies: list[bytes], concurrency: int,
                   max_tokens: int) -> tuple[list[float], float]:
    """Every body sent from `concurrency` clients; each request's seconds and the wall time."""
    latencies: list[float] = []
    queue = iter(bodies)

    async def client() -> None:
        for body in queue:
            sent = time.perf_counter()
            async with http.post("/v1/completions", data=body,
                                 headers={"content-type": "application/json"}) as response:
                answer = await response.read()
            latencies.append(time.perf_counter() - sent)
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {answer[:300]!r}")
            tokens = json.loads(answer)["usage"]["completion_tokens"]
            if tokens != max_tokens:
                raise RuntimeError(f"asked for {max_tokens} tokens, got {tokens}")

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, time.perf_counter() - started


def cpu_seconds(*processes: psutil.Process) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in processes))


async def measure(settings: Settings, rounds: int, requests: int, concurrency: int, max_tokens: int,
                  warmup: int) -> list[Round]:
    key = json.loads(settings.dev_keys_file.read_text())["tenant_key"]
    replica = next(r for r in read_pool(settings).general if r.enabled)
    manifest = read_manifest(settings)
    assert manifest is not None, f"no stack runs in {settings.data_dir}"
    pids = {c.name: c.pid for c in manifest.components}
    gateway_process = psutil.Process(pids["gateway"])
    downstream = [psutil.Process(pids[name]) for name in ("broker", "feedback", "sink") if name in pids]
    rng = random.Random(0)

    def bodies(direct: bool, n: int) -> list[bytes]:
        asked = [{"model": SERVED_MODEL_NAME, "prompt": make_prompt(rng), "max_tokens": max_tokens,
                  "ignore_eos": True} for _ in range(n)]
        return [json.dumps(upstream_body(b, chat=False) if direct else b).encode() for b in asked]

    results: list[Round] = []
    async with session(replica.url, None) as direct, session(settings.url(settings.ports.gateway), key) as gateway:
        targets = {"replica": direct, "gateway": gateway}
        for name, http in targets.items():  # both paths warm (vLLM's first requests, the gateway's clients)
            await send_all(http, bodies(name == "replica", warmup), concurrency, max_tokens)
        for number in range(rounds):
            order = list(targets) if number % 2 == 0 else list(reversed(targets))
            for name in order:
                batch = bodies(name == "replica", requests)
                before = cpu_seconds(gateway_process), cpu_seconds(*downstream)
                latencies, seconds = await send_all(targets[name], batch, concurrency, max_tokens)
                results.append(Round(name, latencies, seconds, cpu_seconds(gateway_process) - before[0],
                                     cpu_seconds(*downstream) - before[1]))
                console.print(f"round {number + 1} {name:8s} {results[-1].per_s:6.1f} req/s  "
                              f"p50 {percentile(latencies, 0.5) * 1000:5.1f} ms  "
                              f"p99 {percentile(latencies, 0.99) * 1000:5.1f} ms")
    return results


def report(results: list[Round]) -> dict[str, Any]:
    table = Table(title="the same completions, to the replica and through the gateway")
    for column in ("target", "req/s (median of rounds)", "range", "p50", "p99", "gateway CPU",
                   "gateway CPU per request", "broker+stream+sink CPU"):
        table.add_column(column, justify="right")
    summary: dict[str, dict[str, Any]] = {}
    for target in ("replica", "gateway"):
        mine = [r for r in results if r.target == target]
        rates = [r.per_s for r in mine]
        latencies = [x for r in mine for x in r.latencies]
        cpu, seconds = sum(r.gateway_cpu_s for r in mine), sum(r.seconds for r in mine)
        summary[target] = {"per_s": statistics.median(rates), "per_s_range": [min(rates), max(rates)],
                           "p50_ms": percentile(latencies, 0.5) * 1000, "p99_ms": percentile(latencies, 0.99) * 1000,
                           "gateway_cores": cpu / seconds, "gateway_cpu_ms_per_request": cpu / len(latencies) * 1000,
                           "downstream_cores": sum(r.downstream_cpu_s for r in mine) / seconds}
        s = summary[target]
        table.add_row(target, f"{s['per_s']:.1f}", f"{min(rates):.1f}-{max(rates):.1f}", f"{s['p50_ms']:.1f} ms",
                      f"{s['p99_ms']:.1f} ms", f"{s['gateway_cores'] * 100:.0f}% of a core",
                      f"{s['gateway_cpu_ms_per_request']:.2f} ms", f"{s['downstream_cores'] * 100:.0f}% of a core")
    console.print(table)
    fewer = 1 - summary["gateway"]["per_s"] / summary["replica"]["per_s"]
    slower = summary["gateway"]["p50_ms"] - summary["replica"]["p50_ms"]
    met = fewer <= 0.05 and slower <= 5
    console.print(f"through the gateway: {fewer * 100:.1f}% fewer requests/s, p50 {slower:+.1f} ms, "
                  f"p99 {summary['gateway']['p99_ms'] - summary['replica']['p99_ms']:+.1f} ms "
                  f"(target: at most 5% fewer and +5 ms at p50: {'met' if met else 'not met'})")
    return dict(summary, fewer_per_s=fewer, p50_added_ms=slower, met=met)


def main(data_dir: Path = typer.Option(Path("/tmp/liverl-bench-gateway"), help="The stack's data directory."),
         running: bool = typer.Option(False, help="Measure the stack already running in --data-dir."),
         port_offset: int = typer.Option(0, help="Ports moved as LIVERL_TEST_PORT_OFFSET moves the suite's."),
         rounds: int = typer.Option(3, min=1, help="Rounds, each target once per round."),
         requests: int = typer.Option(240, min=1, help="Completions per target per round."),
         concurrency: int = typer.Option(8, min=1, help="Concurrent clients."),
         max_tokens: int = typer.Option(24, min=1, help="Tokens per completion (exactly: ignore_eos)."),
         warmup: int = typer.Option(32, min=0, help="Completions per target before the first round."),
         replica_cpus: list[int] = typer.Option([], help="CPUs the replica runs on alone, as an engine on a "
                                                 "device of its own would (repeat the option; none: any CPU)."),
         other_cpus: list[int] = typer.Option([], help="CPUs everything else runs on: the gateway, broker, stream, "
                                              "sink and this script's clients (none: any CPU)."),
         out: Path | None = typer.Option(None, help="Write the summary as JSON here.")) -> None:
    if other_cpus:  # inherited by every process the stack starts; the replica's taskset overrides it
        os.sched_setaffinity(0, other_cpus)
    settings = running_settings(data_dir) if running else bench_settings(data_dir, port_offset, replica_cpus)
    if not running:
        up(settings, say=lambda _: None, progress=False)
    try:
        results = asyncio.run(measure(settings, rounds, requests, concurrency, max_tokens, warmup))
    finally:
        if not running:
            down(settings, say=lambda _: None, force=True)
    summary = report(results) | {"replica_cpus": replica_cpus, "other_cpus": other_cpus}
    if out:
        out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    typer.run(main)
