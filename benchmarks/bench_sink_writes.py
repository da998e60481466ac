"""What one sink write costs: the analytics sink's `store` (parse, duplicate check, insert)
on embedded ClickHouse, CPU per write and per message, by how many messages a write holds;
and, with `--stored`, a batch's time against how many rows its tables already hold.

A write's cost barely depends on its size, so the sink gathers what arrives within
`warehouse.batch_s` into one write per topic.

    .venv/bin/python benchmarks/bench_sink_writes.py
    .venv/bin/python benchmarks/bench_sink_writes.py --stored 1000000 --stored 10000000

With `--stored N`, feedback_events and samples first get N rows each (a month of history,
or `--spread-s` seconds of it, through SQL, so the materialized views see them as they see
the sink's writes), then the
sink stores `--batches` batches of `--batch` fresh feedback events, and as many batches of
samples of which a tenth are revisions of stored samples (once the fill's merges are done);
each batch's wall and CPU time (CPU: the process, chdb's threads included).

With `--phases`, where a batch's CPU goes, per message of each topic a feedback event brings
(its trajectory, the feedback, its sample; gateway-sized: 32 prompt tokens, 24 written with
their logprobs): parsing into the contract and the row, the duplicate check, the JSON of the
insert, and the insert itself (chdb, its materialized views included).

    .venv/bin/python benchmarks/bench_sink_writes.py --phases

Each mode takes `--look-up-every-key`: the sink without its key filter, every row's key
looked up in ClickHouse (as before Nov 30).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from feedback.sink import TABLE_OF, Sink
from feedback.warehouse import open_warehouse, query_json
from liverl.contracts import FeedbackEvent, RequestRecord, RewardedSample, Topics, Trajectory
from liverl.kafka import encode
from liverl.settings import Settings

console = Console(width=160)
FILL = {
    "feedback_events": """INSERT INTO feedback_events SELECT concat('fill-', toString(number)), 'acme',
        now64(3) - toIntervalSecond(number % {spread}), now64(3), concat('c-fill-', toString(number)), 'accept', 1.0,
        '{{"kind":"accept"}}' FROM numbers({n})""",
    "samples": """INSERT INTO samples (event_id, sample_id, revision, tenant, timestamp, served_at, policy_version,
        reward, reward_source, reward_fn_version, accepted, completion_tokens, reward_delta, accepted_delta,
        judged_delta, count_delta, source)
        SELECT concat('acme:fill-', toString(number), ':r0'), concat('acme:fill-', toString(number)), 0, 'acme',
        now64(3) - toIntervalSecond(number % {spread}), now64(3) - toIntervalSecond(number % {spread}), 'v1', 1.0,
        'feedback', 't', 1, 24, 1.0, 1, 1, 1, 'gateway' FROM numbers({n})""",
}


def records(n: int) -> list[bytes]:
    """Gateway request records, as the sink reads them from the requests topic."""
    return [RequestRecord(event_id=uuid.uuid4().hex, tenant="acme", endpoint="/v1/completions", status=200,
                          latency_ms=12.0, policy_version="v1").model_dump_json().encode() for _ in range(n)]


def feedback_events(n: int) -> list[bytes]:
    now = datetime.now(UTC)
    return [encode(FeedbackEvent.model_validate({"event_id": uuid.uuid4().hex, "tenant": "acme", "timestamp": now,
                                                 "body": {"kind": "accept", "completion_id": uuid.uuid4().hex}}))
            for _ in range(n)]


def samples(n: int, stored: int, spread_s: int) -> list[bytes]:
    """Fresh samples, a tenth of them revision 1 of a stored one (served when it was)."""
    out = []
    for i in range(n):
        revised = i % 10 == 0
        number = random.randrange(stored)
        cid = f"fill-{number}" if revised else uuid.uuid4().hex
        served = datetime.fromtimestamp(time.time() - number % spread_s, UTC) if revised else datetime.now(UTC)
        trajectory = Trajectory(event_id=cid, tenant="acme", completion_id=cid, policy_version="v1",
                                timestamp=served, completion_token_ids=[1] * 24, completion_logprobs=[-1.0] * 24)
        revision = 1 if revised else 0
        out.append(encode(RewardedSample(sample_id=f"acme:{cid}", revision=revision, event_id=f"acme:{cid}:r{revision}",
                                         tenant="acme", reward=0.0, reward_source="feedback", reward_fn_version="t",
                                         accepted=False, trajectory=trajectory)))
    return out


def settle(sink: Sink, timeout_s: float = 600) -> None:
    """Until the fill's merges are done: a batch is timed against a store at rest, not beside them."""
    deadline = time.time() + timeout_s
    while query_json(sink.warehouse, "SELECT count() AS n FROM system.merges")[0]["n"] and time.time() < deadline:
        time.sleep(1)


def by_table_size(sizes: list[int], batch: int, batches: int, spread_s: int, remember_keys: bool) -> None:
    table = Table(title=f"sink batches of {batch} against the rows already stored (median of {batches} batches "
                        "each; range in brackets)")
    for column in ("rows stored", "fill", "key filters' load", "feedback batch wall", "feedback batch CPU",
                   "samples batch wall", "samples batch CPU"):
        table.add_column(column, justify="right")
    for size in sizes:
        with tempfile.TemporaryDirectory(dir=os.environ.get("LIVERL_BENCH_TMP")) as data_dir:
            sink = Sink(open_warehouse(Settings(data_dir=Path(data_dir))), remember_keys)
            started = time.time()
            for sql in FILL.values():
                sink.warehouse.command(sql.format(n=size, spread=spread_s))
            fill = time.time() - started
            settle(sink)
            started = time.time()
            held = sum(f.held.nbytes for f in sink.load_keys().values()) if remember_keys else 0
            cells = [f"{time.time() - started:.1f} s, {held / 2**20:.0f} MB" if remember_keys else "(none)"]
            for topic, make in ((Topics.FEEDBACK, lambda: feedback_events(batch)),
                                (Topics.SAMPLES, lambda: samples(batch, size, spread_s))):  # noqa: B023 (called in this iteration)
                walls, cpus = [], []
                for _ in range(batches):
                    messages = make()
                    cpu, wall = time.process_time(), time.perf_counter()
                    sink.store(topic, messages)
                    cpus.append(1000 * (time.process_time() - cpu))
                    walls.append(1000 * (time.perf_counter() - wall))
                cells += [f"{statistics.median(v):.0f} ms ({min(v):.0f}-{max(v):.0f})" for v in (walls, cpus)]
            table.add_row(f"{size:,}", f"{fill:.0f} s", *cells)
            sink.warehouse.close()
        console.print(table)


def event_messages(n: int) -> dict[str, list[bytes]]:
    """n gateway-sized completions: each one's trajectory, feedback and rewarded sample."""
    out: dict[str, list[bytes]] = {Topics.TRAJECTORIES: [], Topics.FEEDBACK: [], Topics.SAMPLES: []}
    for _ in range(n):
        cid = uuid.uuid4().hex
        trajectory = Trajectory(event_id=cid, tenant="acme", completion_id=cid, policy_version="v1",
                                timestamp=datetime.now(UTC), prompt_token_ids=list(range(32)),
                                completion_token_ids=[1] * 24, completion_logprobs=[-1.0] * 24,
                                prompt_text="x" * 120, completion_text="y" * 90)
        out[Topics.TRAJECTORIES].append(encode(trajectory))
        out[Topics.FEEDBACK].append(encode(FeedbackEvent.model_validate({
            "event_id": uuid.uuid4().hex, "tenant": "acme", "timestamp": datetime.now(UTC),
            "body": {"kind": "accept", "completion_id": cid}})))
        out[Topics.SAMPLES].append(encode(RewardedSample(
            sample_id=f"acme:{cid}", revision=0, event_id=f"acme:{cid}:r0", tenant="acme", reward=1.0,
            reward_source="feedback", reward_fn_version="t", accepted=True, trajectory=trajectory)))
    return out


def by_phase(batch: int, batches: int, remember_keys: bool) -> None:
    """The steps of `Sink.store`, timed apart (CPU of the process, chdb's threads included)."""
    phases = ("parse and row", "duplicate check", "insert's JSON", "insert (chdb)")
    spent: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("LIVERL_BENCH_TMP")) as data_dir:
        sink = Sink(open_warehouse(Settings(data_dir=Path(data_dir))), remember_keys)
        for i in range(batches + 3):  # the first three warm the tables up, untimed
            for topic, messages in event_messages(batch).items():
                table_name, marks = TABLE_OF[topic], [time.process_time()]
                rows = sink.parsed(topic, messages)
                marks.append(time.process_time())
                fresh = sink._fresh(table_name, rows)
                marks.append(time.process_time())
                # ChdbBackend.insert's two halves, timed apart.
                body = "\n".join(json.dumps(r, default=str) for r in fresh)
                marks.append(time.process_time())
                sink.warehouse.command(f"INSERT INTO {table_name} FORMAT JSONEachRow\n{body}")
                marks.append(time.process_time())
                if i >= 3:
                    totals = spent.setdefault(table_name, [0.0] * len(phases))
                    for k in range(len(phases)):
                        totals[k] += marks[k + 1] - marks[k]
        sink.warehouse.close()
    table = Table(title=f"the sink's CPU per message, by step: {batches} batches of {batch} per topic")
    for column in ("table", *phases, "all"):
        table.add_column(column, justify="right")
    for table_name, totals in spent.items():
        per = [1e6 * t / (batch * batches) for t in totals]
        table.add_row(table_name, *(f"{p:.1f} µs" for p in per), f"{sum(per):.1f} µs")
    console.print(table)


def main(messages: int = typer.Option(512, help="Messages stored for each write size."),
         stored_before: int = typer.Option(4000, help="Rows in the table before timing (duplicate checks read it)."),
         stored: list[int] = typer.Option([], help="Instead: rows stored before, one run per value."),
         batch: int = typer.Option(2000, help="With --stored: messages per batch."),
         batches: int = typer.Option(10, help="With --stored: batches timed per table."),
         spread_s: int = typer.Option(2_592_000, help="With --stored: the stored rows' times spread over this "
                                      "many seconds before now (a month; 1: all in one second, as the soak's load "
                                      "stamps them)."),
         phases: bool = typer.Option(False, help="Instead: where a batch's CPU goes, by step."),
         remember_keys: bool = typer.Option(True, "--remember-keys/--look-up-every-key", help="The sink's key "
                                            "filter (warehouse.remember_keys), or every key looked up in ClickHouse "
                                            "as before Nov 30.")) -> None:
    if phases:
        return by_phase(batch, batches, remember_keys)
    if stored:
        return by_table_size(stored, batch, batches, spread_s, remember_keys)
    table = Table(title=f"sink writes on embedded ClickHouse: {messages} messages per size, "
                        f"{stored_before} rows stored before")
    for column in ("messages per write", "writes", "CPU per write", "CPU per message", "wall"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as data_dir:
        sink = Sink(open_warehouse(Settings(data_dir=Path(data_dir))), remember_keys)
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
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
