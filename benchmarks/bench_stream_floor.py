"""What reading the feedback stream's backlog costs before the join: the floor under
bench_stream.py's figure, per reader.

    .venv/bin/python benchmarks/bench_stream_floor.py --events 100000 --runs 3

Produces bench_stream.py's backlog (N trajectories, N feedback events) on a fresh embedded
broker, then reads all 2N messages with each reader in a process of its own, one after the
other, and reports each one's CPU-seconds (all its threads, librdkafka's too) from its first
message to its last, as feedback events per CPU-second (N over that CPU time, the unit of
bench_stream.py's target):

- `librdkafka`: a confluent-kafka consumer in a group, `consume()` in batches of the same size,
  reading each message's topic, value, partition, offset and timestamp;
- `aiokafka`: the analytics sink's reader (`feedback/sink.py: gather`, an aiokafka consumer
  in batches of up to 5,000 within the warehouse's batch_s), nothing else;
- `librdkafka+join`: the same as `librdkafka`, each batch through `FeedbackJoin.process` and its samples and
  changed states produced through librdkafka and flushed, as the worker's `send` does (the
  worker's work, less its table recovery and commits).

Until Nov 29 it also read with faust, the stream's framework then (`take_events` batches):
6,299 feedback events per CPU-second (docs/benchmarks.md). That reader left with the
dependency.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import typer
from bench_stream import console, produce_backlog, start_broker
from rich.table import Table

from liverl.kafka import ensure_topics
from liverl.settings import EmbeddedBroker, PortsConfig, Settings, get_settings

READERS = ("aiokafka", "librdkafka", "librdkafka+join")
EVERY_READER = list(READERS)


def report(result: Path, first_cpu: float, messages: int, events: int) -> None:
    """Written to a file, which the parent reads (its standard output is the table's)."""
    cpu_s = time.process_time() - first_cpu
    result.write_text(json.dumps({"cpu_s": cpu_s, "messages": messages, "per_core": events / cpu_s}))
    os._exit(0)


def read_with_aiokafka(bootstrap: str, events: int, result: Path) -> None:
    from aiokafka import AIOKafkaConsumer

    from feedback.sink import gather
    from liverl.contracts import Topics

    async def read() -> None:
        consumer = AIOKafkaConsumer(Topics.TRAJECTORIES, Topics.FEEDBACK, bootstrap_servers=bootstrap,
                                    group_id=f"floor-{uuid.uuid4().hex[:8]}", enable_auto_commit=False,
                                    auto_offset_reset="earliest", max_poll_records=2000)
        await consumer.start()
        messages, first = 0, 0.0
        while messages < 2 * events:
            by_topic = await gather(consumer, get_settings().warehouse.batch_s)
            if by_topic and not messages:
                first = time.process_time()
            messages += sum(len(values) for values in by_topic.values())
        report(result, first, messages, events)

    asyncio.run(read())


def read_with_librdkafka(bootstrap: str, events: int, join: bool, result: Path) -> None:
    from confluent_kafka import Consumer

    from feedback.join import FeedbackJoin
    from feedback.rewards import Rewarder
    from liverl.contracts import Topics
    from liverl.kafka import encode

    settings = get_settings()
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"floor-{uuid.uuid4().hex[:8]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([Topics.TRAJECTORIES, Topics.FEEDBACK])
    producer = None
    if join:
        from confluent_kafka import Producer
        producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5,
                             "partitioner": "murmur2_random"})
        states: dict[str, Any] = {}
        feedback_join = FeedbackJoin(states, Rewarder.from_file(settings.feedback.reward_config),
                                     window_s=settings.feedback.reward_window_s,
                                     max_feedback=settings.feedback.max_feedback_per_completion,
                                     max_unjoined=settings.feedback.max_unjoined_per_tenant)
    messages, first = 0, 0.0
    while True:
        batch = consumer.consume(num_messages=settings.feedback.batch_events, timeout=settings.feedback.batch_s)
        if not batch:
            continue
        if not messages:
            first = time.process_time()
        read = [(m.topic(), m.value(), m.partition(), m.offset(), m.timestamp()) for m in batch if not m.error()]
        messages += len(read)
        if producer is not None:
            out = feedback_join.process([(topic, value, partition) for topic, value, partition, _, _ in read],
                                        time.time())
            for sample in out.samples:
                producer.produce(Topics.SAMPLES, encode(sample), sample.trajectory.completion_id.encode())
            for key, partition in feedback_join.take_changed().items():
                state = states.get(key)
                producer.produce("floor-changelog", None if state is None else encode(state), key.encode(),
                                 partition)
            while producer.flush(0):
                time.sleep(0.002)
        if messages >= 2 * events:
            report(result, first, messages, events)


def one_run(events: int, lag: int, port_offset: int, readers: list[str]) -> dict[str, float]:
    data_dir = Path(tempfile.mkdtemp(prefix="bench-stream-floor-"))
    settings = Settings(data_dir=data_dir, broker=EmbeddedBroker(port=19092 + port_offset),
                        ports=PortsConfig(feedback=18070 + port_offset))
    broker = start_broker(settings, data_dir / "broker.log")
    try:
        asyncio.run(ensure_topics(settings))
        produce_backlog(settings, events, lag)
        results = {}
        env = dict(os.environ, PYTHONUNBUFFERED="1", **settings.environment())
        for reader in readers:
            result = data_dir / f"{reader}.json"
            with console.status(f"reading with {reader}"):
                done = subprocess.run([sys.executable, __file__, "--reader", reader, "--events", str(events),
                                       "--bootstrap", settings.bootstrap, "--port-offset", str(port_offset),
                                       "--result", str(result)],
                                      env=env, capture_output=True, text=True, timeout=3600)
            if not result.exists():
                raise RuntimeError(f"{reader} reported nothing: {done.stdout[-2000:]} {done.stderr[-2000:]}")
            results[reader] = json.loads(result.read_text())["per_core"]
            console.print(f"{reader}: {results[reader]:,.0f} feedback events per CPU-second")
        return results
    finally:
        broker.terminate()
        broker.wait(30)
        shutil.rmtree(data_dir, ignore_errors=True)


def main(events: int = typer.Option(100_000, help="Feedback events in the backlog (and as many trajectories)."),
         lag: int = typer.Option(5000, help="How many completions behind its trajectory each feedback comes."),
         runs: int = typer.Option(1, help="Runs, each on a fresh broker."),
         port_offset: int = typer.Option(0, help="Added to the broker's and the readers' default ports."),
         reader: list[str] = typer.Option(EVERY_READER, help="Readers to run: aiokafka, librdkafka, "
                                          "librdkafka+join."),
         bootstrap: str = typer.Option("", hidden=True, help="Set: be that reader on this broker (internal)."),
         result: Path = typer.Option(Path("floor.json"), hidden=True, help="Where that reader writes (internal)."),
         out: Path | None = typer.Option(None, help="Write every run's figures as JSON here.")) -> None:
    # As the stream's worker: its table's small objects would otherwise keep the collector busy.
    gc.set_threshold(100_000, 50, 100)
    if bootstrap:
        if reader[0] == "aiokafka":
            read_with_aiokafka(bootstrap, events, result)
        read_with_librdkafka(bootstrap, events, reader[0] == "librdkafka+join", result)
        return
    unknown = set(reader) - set(READERS)
    if unknown:
        raise typer.BadParameter(f"unknown reader(s) {sorted(unknown)}; choose from {', '.join(READERS)}")
    runs_done = [one_run(events, lag, port_offset, reader) for _ in range(runs)]
    table = Table(title=f"reading a backlog of {events:,} feedback events and their trajectories: "
                        "feedback events per CPU-second")
    for column in ("reader", *(f"run {i + 1}" for i in range(runs)), "median"):
        table.add_column(column, justify="right")
    for name in reader:
        figures = [run[name] for run in runs_done]
        table.add_row(name, *(f"{f:,.0f}" for f in figures), f"{statistics.median(figures):,.0f}")
    console.print(table)
    if out:
        out.write_text(json.dumps({"events": events, "runs": runs_done}, indent=1))


if __name__ == "__main__":
    typer.run(main)
