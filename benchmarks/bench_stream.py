"""The feedback stream alone, draining a backlog: joined feedback events per CPU-second.

    .venv/bin/python benchmarks/bench_stream.py --events 1000000 [--runs 3]

Starts an embedded broker (Tansu, in memory) and nothing else of the stack, produces N
trajectories and their N feedback events (each feedback `--lag` completions behind its
trajectory, as a product answers a little after it was served; accept, reject and
thumbs in turn), then starts a stream worker (`python -m feedback.stream`, librdkafka since Nov 29) on
that backlog and counts the samples it emits until all N are out. The rate per core is
N joined over the CPU seconds the worker spent between its first and its last sample
(the worker is the only process doing join work; the broker's CPU over the same span
is reported beside it, and the wall-clock rate too). Every sample id must be seen
exactly once.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil
import typer
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from app.broker import tansu_binary
from liverl.contracts import FeedbackEvent, RewardedSample, Topics, Trajectory
from liverl.kafka import encode, ensure_topics
from liverl.settings import EmbeddedBroker, PortsConfig, Settings

console = Console(width=160)
KINDS = ({"kind": "accept"}, {"kind": "reject"}, {"kind": "thumbs", "up": True})


def trajectory(i: int, now: datetime) -> bytes:
    """A gateway-sized trajectory: 32 prompt tokens, 24 written with their logprobs."""
    return encode(Trajectory(
        event_id=f"t{i}", tenant="acme", completion_id=f"c{i}", policy_version="v1", timestamp=now,
        replica="replica-0", prompt_text="def add(a, b):\n" * 2, completion_text="    return a + b\n" * 2,
        prompt_token_ids=list(range(32)), completion_token_ids=list(range(24)),
        completion_logprobs=[-0.5] * 24, finish_reason="length", latency_ms=80.0))


def feedback(i: int, now: datetime) -> bytes:
    return encode(FeedbackEvent.model_validate({
        "event_id": f"f{i}", "tenant": "acme", "timestamp": now,
        "body": {**KINDS[i % len(KINDS)], "completion_id": f"c{i}"}}))


def produce_backlog(settings: Settings, events: int, lag: int) -> None:
    """Trajectory i, then the feedback on completion i - lag; the last `lag` feedback at the end."""
    producer = Producer({"bootstrap.servers": settings.bootstrap, "acks": "all",
                         "partitioner": "murmur2_random", "linger.ms": 20, "queue.buffering.max.messages": 200_000})
    now = datetime.now(UTC)

    def send(topic: str, key: str, value: bytes) -> None:
        while True:
            try:
                producer.produce(topic, value, key.encode())
                return
            except BufferError:
                producer.poll(0.05)

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("producing the backlog", total=2 * events)
        for i in range(events + lag):
            if i < events:
                send(Topics.TRAJECTORIES, f"c{i}", trajectory(i, now))
            if i >= lag:
                send(Topics.FEEDBACK, f"c{i - lag}", feedback(i - lag, now))
            if i % 5000 == 0:
                producer.poll(0)
                progress.update(task, completed=min(i, events) + max(i - lag, 0))
        producer.flush(120)


def start_broker(settings: Settings, log: Path) -> subprocess.Popen:
    assert isinstance(settings.broker, EmbeddedBroker)
    listener = f"tcp://{settings.host}:{settings.broker.port}"
    with socket.socket() as probe:
        if probe.connect_ex((settings.host, settings.broker.port)) == 0:
            raise RuntimeError(f"port {settings.broker.port} is taken: another broker (another run?); "
                               "pick another --port-offset")
    process = subprocess.Popen([str(tansu_binary()), "broker", "--cluster-id", "bench-stream",
                                "--listener-url", listener, "--advertised-listener-url", listener,
                                "--storage-engine", "memory://tansu/"],
                               stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection((settings.host, settings.broker.port), timeout=1).close()
            return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the broker did not listen within 30 s; see {log}")


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def drain(settings: Settings, events: int, log: Path, timeout_s: float) -> dict:
    """Starts the worker and counts its samples; CPU of worker and broker from first to last."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **settings.environment())
    worker = subprocess.Popen([sys.executable, "-m", "feedback.stream", "--port", str(settings.ports.feedback)],
                              env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": "bench-stream-count",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    # Assigned, not subscribed: a group that rebalanced on a busy machine would read from the start again.
    metadata = consumer.list_topics(timeout=10).topics
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for topic in (Topics.SAMPLES, Topics.DEAD_LETTER)
                     for p in metadata[topic].partitions])
    seen: set[str] = set()
    letters = repeats = 0
    first = last = None
    try:
        proc = psutil.Process(worker.pid)
        deadline = time.time() + timeout_s
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("joining", total=events)
            while len(seen) < events and time.time() < deadline and worker.poll() is None:
                for message in consumer.consume(num_messages=5000, timeout=0.5):
                    if message.error():
                        continue
                    if message.topic() == Topics.DEAD_LETTER:
                        letters += 1
                        continue
                    if first is None:
                        first = (time.time(), cpu_seconds(proc), cpu_seconds(broker_process(settings)))
                    sample_id = RewardedSample.model_validate_json(message.value() or b"").sample_id
                    repeats += sample_id in seen
                    seen.add(sample_id)
                last = (time.time(), cpu_seconds(proc), cpu_seconds(broker_process(settings)))
                progress.update(task, completed=len(seen))
            rss = proc.memory_info().rss
    finally:
        worker.terminate()
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:  # a clean stop can take longer on a busy machine
            worker.kill()
            worker.wait()
        consumer.close()
    if first is None or last is None or len(seen) < events:
        raise RuntimeError(f"{len(seen)} of {events} samples within {timeout_s:.0f} s; see {log}")
    wall, cpu, broker_cpu = (b - a for a, b in zip(first, last, strict=True))
    return {"joined": len(seen), "wall_s": wall, "worker_cpu_s": cpu, "broker_cpu_s": broker_cpu,
            "per_core": len(seen) / cpu, "per_wall_s": len(seen) / wall, "rss_mb": rss / 2**20,
            "dead_letters": letters, "repeats": repeats}


_broker: dict[str, psutil.Process] = {}


def broker_process(settings: Settings) -> psutil.Process:
    return _broker[settings.bootstrap]


def one_run(events: int, lag: int, port_offset: int, timeout_s: float) -> dict:
    data_dir = Path(tempfile.mkdtemp(prefix="bench-stream-", dir=os.environ.get("LIVERL_BENCH_TMP")))
    settings = Settings(data_dir=data_dir, broker=EmbeddedBroker(port=19092 + port_offset),
                        ports=PortsConfig(feedback=18070 + port_offset))
    broker = start_broker(settings, data_dir / "broker.log")
    _broker[settings.bootstrap] = psutil.Process(broker.pid)
    try:
        asyncio.run(ensure_topics(settings))
        started = time.time()
        produce_backlog(settings, events, lag)
        console.print(f"backlog of {events:,} trajectories and {events:,} feedback events "
                      f"produced in {time.time() - started:.0f} s")
        return drain(settings, events, data_dir / "worker.log", timeout_s)
    finally:
        broker.terminate()
        broker.wait(30)
        if not os.environ.get("LIVERL_BENCH_KEEP"):
            shutil.rmtree(data_dir, ignore_errors=True)


def main(events: int = typer.Option(1_000_000, help="Feedback events in the backlog (and as many trajectories)."),
         lag: int = typer.Option(5000, help="How many completions behind its trajectory each feedback comes."),
         runs: int = typer.Option(1, help="Runs, each on a fresh broker."),
         port_offset: int = typer.Option(0, help="Added to the broker's and the worker's default ports."),
         timeout_s: float = typer.Option(3600.0, help="Give up on a run after this long.")) -> None:
    table = Table(title=f"the feedback stream draining {events:,} feedback events and their trajectories")
    for column in ("run", "joined", "wall", "worker CPU", "joined / CPU-s", "joined / s", "broker CPU",
                   "worker RSS", "dead letters", "repeats"):
        table.add_column(column, justify="right")
    for run in range(runs):
        r = one_run(events, lag, port_offset, timeout_s)
        table.add_row(str(run + 1), f"{r['joined']:,}", f"{r['wall_s']:.1f} s", f"{r['worker_cpu_s']:.1f} s",
                      f"{r['per_core']:,.0f}", f"{r['per_wall_s']:,.0f}", f"{r['broker_cpu_s']:.1f} s",
                      f"{r['rss_mb']:,.0f} MB", str(r["dead_letters"]), str(r["repeats"]))
        console.print(table)


if __name__ == "__main__":
    typer.run(main)
