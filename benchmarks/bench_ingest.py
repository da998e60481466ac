"""Ingest throughput and event-to-ClickHouse latency, with the whole embedded stack up.

    .venv/bin/python benchmarks/bench_ingest.py [--seconds 30] [--concurrency 8] [--burst-only]

Once the stack is quiet (vLLM's warm-up and the learner's start-up go on after `up`
reports healthy), sends batches of 100 feedback events (~300 bytes each) to POST
/v1/ingestion from several concurrent clients for a fixed time; reports accepted events/s and per-batch
latency percentiles. Then waits until the feedback stream and the sink have caught up
with the burst (how long that takes is reported too), and marks single events and
times how long each takes to be visible in ClickHouse (through the sink, as `liverl
sql` sees it).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid

import aiohttp
import httpx
import psutil
import typer
import uvloop
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from app.stack import down, drain, up
from liverl.keys import admin_headers
from liverl.manifest import read_manifest
from liverl.pool import read_pool
from liverl.settings import Settings

console = Console()


def feedback_batch(size: int) -> dict:
    batch = []
    for _ in range(size):
        cid = f"cmpl-bench-{uuid.uuid4().hex}"
        batch.append({"id": f"evt-{uuid.uuid4().hex}", "type": "feedback",
                      "timestamp": "2026-11-22T12:00:00Z",
                      "body": {"kind": "edit", "completion_id": cid,
                               "corrected_text": "def add(a, b):\n    return a + b\n" * 3}})
    return {"batch": batch}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def throughput(url: str, key: str, seconds: float, concurrency: int, batch_size: int) -> dict:
    latencies: list[float] = []
    accepted = 0
    payloads = [json.dumps(feedback_batch(batch_size)).encode() for _ in range(50)]
    deadline = time.perf_counter() + seconds

    async def client(i: int, http: aiohttp.ClientSession) -> None:
        nonlocal accepted
        n = i
        while time.perf_counter() < deadline:
            # Fresh event and completion ids per send: a repeated event id would be a cheap
            # duplicate, and a completion rarely gets more than a few feedback events.
            prefix = f"{n:07d}-".encode()
            body = (payloads[n % len(payloads)].replace(b"evt-", b"e" + prefix, batch_size)
                    .replace(b"cmpl-bench-", b"c" + prefix, batch_size))
            n += concurrency
            t = time.perf_counter()
            async with http.post("/v1/ingestion", data=body) as response:
                answer = await response.json()
            latencies.append(time.perf_counter() - t)
            accepted += answer["accepted"]

    started = time.perf_counter()
    # aiohttp (C HTTP parser) rather than httpx: the client shares the machine's two cores
    # with the stack it measures, so the less it spends the more the stack gets.
    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=30), headers={
            "Authorization": f"Bearer {key}", "content-type": "application/json"}) as http:
        await asyncio.gather(*(client(i, http) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {"events_per_s": accepted / elapsed, "batches": len(latencies),
            "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * percentile(latencies, 0.99)}


def settle(settings: Settings, quiet_cores: float, timeout_s: float = 180.0) -> float:
    """Wait until the stack together uses less than `quiet_cores` of CPU over 2 s (vLLM's
    warm-up and the learner's start-up run on after `up` is healthy); seconds waited."""
    started = time.perf_counter()
    processes = []
    # The replicas are in the pool, not the manifest: their warm-up is what lasts longest.
    pids = [c.pid for c in read_manifest(settings).components] + [r.pid for r in read_pool(settings).replicas if r.pid]
    for pid in pids:
        root = psutil.Process(pid)
        processes += [root, *root.children(recursive=True)]

    def cpu_seconds() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in processes if p.is_running())

    while time.perf_counter() - started < timeout_s:
        before = cpu_seconds()
        time.sleep(2)
        if cpu_seconds() - before < 2 * quiet_cores:
            break
    return time.perf_counter() - started


def visibility(settings: Settings, key: str, samples: int) -> dict:
    api = settings.url(settings.ports.api) + "/v1/ingestion"
    sink = settings.url(settings.ports.sink) + "/sql"
    delays = []
    with Progress(console=console) as bar:
        task = bar.add_task("event -> ClickHouse", total=samples)
        for _ in range(samples):
            batch = feedback_batch(1)
            event_id = batch["batch"][0]["id"]
            t = time.perf_counter()
            httpx.post(api, json=batch, headers={"Authorization": f"Bearer {key}"}, timeout=30)
            while True:
                rows = httpx.post(sink, json={"sql": f"SELECT count() AS n FROM feedback_events "
                                                     f"WHERE event_id = '{event_id}'", "format": "json"},
                                  headers=admin_headers(settings), timeout=30).json()["data"]
                if rows[0]["n"]:
                    break
                time.sleep(0.02)
            delays.append(time.perf_counter() - t)
            bar.advance(task)
    return {"p50_s": statistics.median(delays), "p95_s": percentile(delays, 0.95), "max_s": max(delays)}


def main(seconds: float = 30.0, concurrency: int = 8, batch_size: int = 100, visibility_samples: int = 40,
         burst_only: bool = typer.Option(False, help="Only the throughput phase: no catch-up, no visibility."),
         quiet_cores: float = typer.Option(0.25, help="Start the burst once the stack uses less CPU than this."),
         ) -> None:
    settings = Settings()
    started_here = read_manifest(settings) is None
    if started_here:
        up(settings, say=console.print)
    try:
        key = json.loads((settings.data_dir / "dev-keys.json").read_text())["tenant_key"]
        console.print(f"the stack settled in {settle(settings, quiet_cores):.0f} s")
        console.print(f"sending batches of {batch_size} for {seconds:.0f} s from {concurrency} clients")
        result = uvloop.run(throughput(settings.url(settings.ports.api), key, seconds, concurrency, batch_size))
        console.print(f"accepted {result['events_per_s']:,.0f} events/s; per batch p50 {result['p50_ms']:.1f} ms, "
                      f"p99 {result['p99_ms']:.1f} ms")
        if not burst_only:
            # The stream and the sink run niced (`stream_nice`): during the burst they fall
            # behind, and catch up after it. Visibility is timed once they have.
            started = time.perf_counter()
            with console.status("the feedback stream and the sink catching up") as status:
                drain(settings, timeout=900, say=lambda lags: status.update(f"catching up: {lags}"))
            result["catch_up_s"] = time.perf_counter() - started
            result.update({f"visible_{k}": v for k, v in visibility(settings, key, visibility_samples).items()})
    finally:
        if started_here:
            down(settings, say=console.print, force=True)
    table = Table(title="ingest benchmark")
    for k in result:
        table.add_column(k)
    table.add_row(*(f"{v:,.1f}" if isinstance(v, float) else str(v) for v in result.values()))
    console.print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    typer.run(main)
