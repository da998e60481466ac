"""How long the embedded broker takes to acknowledge a record at a day's peak, against the
batches its partitions keep (issue 44: the day's gateway saw no ack for 10 s at a time).

    .venv/bin/python benchmarks/bench_broker_acks.py --retention-batches 2000 --retention-check-s 60
    .venv/bin/python benchmarks/bench_broker_acks.py  # the defaults (broker.retention_*)

Starts Tansu on its disk store (app.broker_store) alone, as `liverl up` does, on a fresh
directory; produces `--rate` records a second of 600 bytes, round robin over the requests,
feedback and samples topics, with the gateway recorder's producer settings (acks=all, linger
5 ms); `--groups` consumer groups (one a topic, up to three) read at the head meanwhile, as the
sink, stream and learner do. Reports each record's time to its acknowledgement (median, p99,
max, how many took over 1 s and from which second on), the CPU-seconds of Tansu and of its
store, and the batch objects left on disk. Tansu writes one object a produce request, so at a
few records a request a partition gains batches at about the record rate over partitions.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import typer
from confluent_kafka import Consumer, Producer
from rich.console import Console
from rich.progress import Progress

from app.broker import broker_dir, cluster_id
from app.stack import Launcher
from liverl.contracts import Topics
from liverl.kafka import ensure_topics
from liverl.process import stop_pid
from liverl.settings import EmbeddedBroker, Settings

console = Console(width=140)
TOPICS = (Topics.REQUESTS, Topics.FEEDBACK, Topics.SAMPLES)


def read_at_head(bootstrap: str, group: str, topic: str, until: float) -> None:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    while time.time() < until:
        consumer.poll(0.5)
    consumer.close()


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main(seconds: float = typer.Option(150.0, help="How long to produce."),
         rate: float = typer.Option(150.0, help="Records a second (the day's peak on the stack is about 100-150)."),
         groups: int = typer.Option(3, min=0, max=3, help="Consumer groups reading at the head."),
         retention_batches: int | None = typer.Option(None, help="broker.retention_batches (default: setting's)."),
         retention_check_s: float | None = typer.Option(None, help="broker.retention_check_s (default: setting's)."),
         port: int = typer.Option(29600, help="The broker's port (its store: the next one)."),
         out: Path | None = typer.Option(None, help="Write the result here as JSON.")) -> None:
    data = Path(tempfile.mkdtemp(prefix="bench-broker-acks-"))
    given = {k: v for k, v in (("retention_batches", retention_batches), ("retention_check_s", retention_check_s))
             if v is not None}
    settings = Settings(data_dir=data, broker=EmbeddedBroker(port=port, storage="disk", **given))
    broker = settings.broker
    assert isinstance(broker, EmbeddedBroker)
    settings.broker_cluster_id = cluster_id(settings)
    launcher = Launcher(settings, say=lambda _: None)
    acks: list[tuple[float, float]] = []  # (second sent, seconds to the ack)
    failed = 0
    try:
        launcher.broker()
        ensure_topics(settings)
        processes = {c.name: psutil.Process(c.pid) for c in launcher.started}
        before = {name: cpu_seconds(p) for name, p in processes.items()}
        start = time.time()
        until = start + seconds
        readers = [threading.Thread(target=read_at_head, args=(settings.bootstrap, f"bench-{t}", t, until))
                   for t in TOPICS[:groups]]
        for reader in readers:
            reader.start()
        producer = Producer({"bootstrap.servers": settings.bootstrap, "acks": "all", "linger.ms": 5,
                             "message.timeout.ms": 60_000})

        def delivered(error, _message, sent: float) -> None:
            nonlocal failed
            if error is not None:
                failed += 1
            else:
                acks.append((sent - start, time.time() - sent))

        sent = 0
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"{rate:.0f} records/s", total=seconds)
            while (now := time.time()) < until:
                producer.produce(TOPICS[sent % len(TOPICS)], b"x" * 600,
                                 on_delivery=lambda e, m, at=now: delivered(e, m, at))
                sent += 1
                producer.poll(0)
                progress.update(task, completed=now - start)
                time.sleep(max(0.0, start + sent / rate - time.time()))
            producer.flush(120)
        for reader in readers:
            reader.join()
        cpu = {name: round(cpu_seconds(p) - before[name], 1) for name, p in processes.items()}
    finally:
        for component in reversed(launcher.started):
            stop_pid(component.pid, timeout=1)
    waits = sorted(w for _, w in acks)
    slow = [at for at, w in acks if w > 1.0]
    result = {
        "seconds": seconds, "rate": rate, "groups": groups, "retention_batches": broker.retention_batches,
        "retention_check_s": broker.retention_check_s, "sent": sent, "acknowledged": len(acks), "failed": failed,
        "ack_s": {"median": statistics.median(waits), "p99": waits[int(0.99 * (len(waits) - 1))], "max": waits[-1]},
        "over_1s": len(slow), "first_over_1s_at_s": round(min(slow), 1) if slow else None, "cpu_s": cpu,
        "objects_left": sum(len(files) for _, _, files in os.walk(broker_dir(settings))),
        "machine": f"{os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    shutil.rmtree(data, ignore_errors=True)
    console.print_json(json.dumps(result))
    if out is not None:
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    typer.run(main)
