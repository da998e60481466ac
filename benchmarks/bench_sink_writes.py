"""What one sink write costs: the analytics sink's `store` (parse, duplicate check, insert)
on embedded ClickHouse, CPU per write and per message, by how many messages a write holds.

A write's cost barely depends on its size, so the sink gathers what arrives within
`warehouse.batch_s` into one write per topic.

    .venv/bin/python benchmarks/bench_sink_writes.py
"""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from feedback.sink import Sink
from feedback.warehouse import open_warehouse
from liverl.contracts import RequestRecord, Topics
from liverl.settings import Settings


def records(n: int) -> list[bytes]:
    """Gateway request records, as the sink reads them from the requests topic."""
    return [RequestRecord(event_id=uuid.uuid4().hex, tenant="acme", endpoint="/v1/completions", status=200,
                          latency_ms=12.0, policy_version="v1").model_dump_json().encode() for _ in range(n)]


def main(messages: int = typer.Option(512, help="Messages stored for each write size."),
         stored_before: int = typer.Option(4000, help="Rows in the table before timing (duplicate checks read it).")
         ) -> None:
    table = Table(title=f"sink writes on embedded ClickHouse: {messages} messages per size, "
                        f"{stored_before} rows stored before")
    for column in ("messages per write", "writes", "CPU per write", "CPU per message", "wall"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as data_dir:
        sink = Sink(open_warehouse(Settings(data_dir=Path(data_dir))))
        for _ in range(stored_before // 200):
            sink.store(Topics.REQUESTS, records(200))
        for size in (1, 4, 16, 64, 256):
            writes = [records(size) for _ in range(messages // size)]
            cpu, wall = time.process_time(), time.time()  # process time: chdb's own threads count
            for write in writes:
                sink.store(Topics.REQUESTS, write)
            cpu, wall = time.process_time() - cpu, time.time() - wall
            table.add_row(str(size), str(len(writes)), f"{1000 * cpu / len(writes):.2f} ms",
                          f"{1000 * cpu / (len(writes) * size):.3f} ms", f"{wall:.2f} s")
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
