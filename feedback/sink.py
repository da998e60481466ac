"""The analytics sink: every topic into ClickHouse, and the one door to chdb.

In embedded mode chdb can be open in one process only, so this process also answers
analysts' read-only SQL (`liverl sql`, `liverl metrics`) over HTTP.

Offsets are committed after the rows are stored: a crash redelivers, and rows whose
event id is already stored are skipped, so nothing is lost or counted twice. Both checks
a batch makes (ids stored, latest revisions of its samples) are one query each of point
lookups in key-value tables, so a batch costs about the same however much is stored, and
only of the keys a filter in memory says may be there (feedback/key_filter.py): a new row,
nearly every row, is not looked up at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import PlainTextResponse
from prometheus_client import Counter, Gauge
from pydantic import AwareDatetime, BaseModel, Field, ValidationError

from feedback.analyst_sql import RefusedQuery, prepare
from feedback.key_filter import KeyFilter
from feedback.warehouse import FORMATS, KEYED, Warehouse, open_warehouse, query_json
from liverl.contracts import (
    CapacityEvent,
    DeadLetter,
    FeedbackEvent,
    PolicyVersionEvent,
    RequestRecord,
    RewardedSample,
    Topics,
    Trajectory,
    VersionName,
)
from liverl.http import Audit, service_app
from liverl.keys import KeyRecord, require_admin, require_key
from liverl.observability import log, setup_logging
from liverl.settings import Settings, get_settings

GROUP = "liverl-sink"
ROWS = Counter("liverl_sink_rows_total", "Rows stored by table and outcome", ["table", "outcome"])
WRITES = Counter("liverl_sink_writes_total", "Inserts into ClickHouse by table", ["table"])
STORED_OFFSET = Gauge("liverl_sink_committed", "Messages committed", ["topic"])
logger = setup_logging("sink")

TABLE_OF = {
    Topics.FEEDBACK: "feedback_events",
    Topics.TRAJECTORIES: "trajectories",
    Topics.SAMPLES: "samples",
    Topics.REQUESTS: "requests",
    Topics.DEAD_LETTER: "dead_letters",
    Topics.POLICY_VERSIONS: "policy_versions",
    Topics.CAPACITY: "capacity_events",
}
UNTENANTED = {"policy_versions", "capacity_events"}


def quote(value: str) -> str:
    """A ClickHouse string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _ts(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def feedback_row(e: FeedbackEvent) -> dict:
    body = e.body
    value = {"accept": 1.0, "reject": 0.0}.get(body.kind)
    if body.kind == "thumbs":
        value = 1.0 if body.up else 0.0
    elif body.kind == "score":
        value = body.score
    elif body.kind == "outcome":
        value = body.value
    return dict(event_id=e.event_id, tenant=e.tenant, timestamp=_ts(e.timestamp),
                received_at=_ts(e.received_at), completion_id=body.completion_id,
                kind=body.kind, value=value, payload=body.model_dump_json())


def trajectory_row(t: Trajectory) -> dict:
    return dict(event_id=t.event_id, tenant=t.tenant, timestamp=_ts(t.timestamp),
                completion_id=t.completion_id, group_id=t.group_id,
                policy_version=t.policy_version, replica=t.replica or "", source=t.source,
                prompt_tokens=t.token_counts()[0], completion_tokens=t.token_counts()[1],
                finish_reason=t.finish_reason or "", latency_ms=t.latency_ms,
                has_routed_experts=int(t.routed_experts is not None),
                prompt_text=t.prompt_text, completion_text=t.completion_text,
                payload=t.model_dump_json(include={"sampling", "turns"}))


def request_row(r: RequestRecord) -> dict:
    return dict(event_id=r.event_id, tenant=r.tenant, timestamp=_ts(r.timestamp),
                completion_id=r.completion_id, policy_version=r.policy_version or "",
                replica=r.replica or "", endpoint=r.endpoint, status=r.status, error=r.error,
                latency_ms=r.latency_ms, stream=int(r.stream))


def dead_letter_row(d: DeadLetter) -> dict:
    return dict(event_id=d.event_id, timestamp=_ts(d.timestamp), source_topic=d.source_topic,
                reason=d.reason, tenant=d.tenant, payload=d.payload)


def sample_row(s: RewardedSample) -> dict:
    """A sample's row, counted as a new sample; Sink.correct_revisions makes a revision a correction."""
    return dict(event_id=s.event_id, sample_id=s.sample_id, revision=s.revision, tenant=s.tenant,
                timestamp=_ts(s.timestamp), served_at=_ts(s.trajectory.timestamp),
                policy_version=s.trajectory.policy_version, reward=s.reward, reward_source=s.reward_source,
                reward_fn_version=s.reward_fn_version, accepted=None if s.accepted is None else int(s.accepted),
                completion_tokens=s.trajectory.token_counts()[1], reward_delta=s.reward,
                accepted_delta=int(bool(s.accepted)), judged_delta=int(s.accepted is not None), count_delta=1,
                source=s.trajectory.source)


def policy_version_row(p: PolicyVersionEvent) -> dict:
    return dict(event_id=p.event_id, version=p.version, parent=p.parent,
                created_at=_ts(datetime.fromtimestamp(p.created_at, UTC)),
                updated_at=_ts(p.timestamp), state=p.state, content_hash=p.content_hash,
                metrics=json.dumps(p.metrics))


LOOKUP_KEYS = 1000  # ids per duplicate lookup: a query's text stays far below ClickHouse's 256 KiB


def event_key(table: str, tenant: str | None, event_id: str) -> str:
    """A big table's row in event_keys (feedback/warehouse.py names it the same)."""
    return f"{table}:{tenant}:{event_id}"


def sample_key(row: dict) -> str:
    """A sample's key in sample_latest."""
    return f"{row['tenant']}:{row['sample_id']}"


class Sink:
    def __init__(self, warehouse: Warehouse, remember_keys: bool = True):
        self.warehouse = warehouse
        self.remember_keys = remember_keys
        self.filters: dict[str, KeyFilter] = {}  # by key table
        self.reload = True  # load the filters before the next check

    def load_keys(self) -> dict[str, KeyFilter]:
        """The key filters, loaded from the warehouse first if they were forgotten."""
        if self.reload:
            self.reload = False  # before: partitions given while they load make them load again
            self.filters = {table: KeyFilter.load(self.warehouse, table) for table in ("event_keys", "sample_latest")}
        return self.filters

    def forget_keys(self) -> None:
        """Load the key filters again before the next check: another sink may have written."""
        self.reload = True

    def _may_hold(self, key_table: str, keys: dict[str, Any]) -> dict[str, Any]:
        """Those of `keys` that `key_table` may hold: all of them without a key filter."""
        if not self.remember_keys:
            return keys
        maybe = self.load_keys()[key_table].maybe_stored(list(keys))
        return {key: value for (key, value), held in zip(keys.items(), maybe, strict=True) if held}

    def _lookup(self, sql: str, values: list[str]) -> list[dict]:
        """`sql`'s rows, its `{}` the values as string literals, LOOKUP_KEYS at a time:
        ClickHouse refuses a query text past 256 KiB (max_query_size), which a backlog's
        batch of long ids passed (the broker-kill test found it)."""
        return [row for i in range(0, len(values), LOOKUP_KEYS)
                for row in query_json(self.warehouse, sql.format(",".join(map(quote, values[i:i + LOOKUP_KEYS]))))]

    def _stored_keys(self, table: str, rows: dict[tuple[str | None, str], dict]) -> set[tuple[str | None, str]]:
        """Which (tenant, event_id) pairs are stored: an event id is the tenant's own name,
        so another tenant's event with the same id is not a duplicate. A big table's ids are
        point lookups in event_keys (the cost is the batch's, not the table's), of only
        those its key filter may hold; the small ones are read by event id."""
        if table in KEYED:
            keys = self._may_hold("event_keys", {event_key(table, tenant, event_id): (tenant, event_id)
                                                 for tenant, event_id in rows})
            return {keys[r["key"]] for r in self._lookup("SELECT key FROM event_keys WHERE key IN ({})", list(keys))}
        tenant = "NULL" if table in UNTENANTED else "tenant"
        found = self._lookup(f"SELECT {tenant} AS tenant, event_id FROM {table} WHERE event_id IN ({{}})",
                             [event_id for _, event_id in rows])
        return {(r["tenant"], r["event_id"]) for r in found}

    def _latest_revisions(self, rows: list[dict]) -> dict[str, dict]:
        """The latest stored revision of these samples, by sample id: point lookups in
        sample_latest of those its key filter may hold."""
        keys = self._may_hold("sample_latest", {sample_key(r): r["sample_id"] for r in rows})
        found = self._lookup("SELECT key, revision, reward, accepted FROM sample_latest WHERE key IN ({})", list(keys))
        return {keys[row["key"]]: row for row in found}

    def correct_revisions(self, rows: list[dict], stored: dict[str, dict]) -> None:
        """A revision is a correction: the rollup gets the difference from the latest earlier
        revision (in this batch, or stored), not a second sample."""
        latest: dict[str, dict] = {}  # this batch's newest revision of each sample so far
        for row in rows:
            earlier = [r for r in (latest.get(row["sample_id"]), stored.get(row["sample_id"]))
                       if r is not None and r["revision"] < row["revision"]]
            if earlier:
                prev = max(earlier, key=lambda r: r["revision"])
                judged, prev_judged = row["accepted"] is not None, prev["accepted"] is not None
                row.update(reward_delta=row["reward"] - prev["reward"],
                           accepted_delta=int(bool(row["accepted"])) - int(bool(prev["accepted"])),
                           judged_delta=int(judged) - int(prev_judged), count_delta=0)
            if row["sample_id"] not in latest or latest[row["sample_id"]]["revision"] < row["revision"]:
                latest[row["sample_id"]] = row

    def _fresh(self, table: str, rows: dict[tuple[str | None, str], dict]) -> list[dict]:
        """The rows not stored yet; samples corrected against their earlier revisions."""
        if table != "samples":
            stored = self._stored_keys(table, rows)
            return [r for key, r in rows.items() if key not in stored]
        latest = self._latest_revisions(list(rows.values()))
        # Against every revision in the batch: a stored one in it is still the one before.
        self.correct_revisions(list(rows.values()), latest)
        return [r for r in rows.values()
                if r["sample_id"] not in latest or r["revision"] > latest[r["sample_id"]]["revision"]]

    def to_row(self, topic: str, raw: bytes) -> dict:
        if topic == Topics.FEEDBACK:
            return feedback_row(FeedbackEvent.model_validate_json(raw))
        if topic == Topics.TRAJECTORIES:
            return trajectory_row(Trajectory.model_validate_json(raw))
        if topic == Topics.SAMPLES:
            return sample_row(RewardedSample.model_validate_json(raw))
        if topic == Topics.REQUESTS:
            return request_row(RequestRecord.model_validate_json(raw))
        if topic == Topics.POLICY_VERSIONS:
            return policy_version_row(PolicyVersionEvent.model_validate_json(raw))
        if topic == Topics.CAPACITY:
            event = CapacityEvent.model_validate_json(raw)
            return dict(event.model_dump(exclude={"schema_version"}), timestamp=_ts(event.timestamp),
                        steps=json.dumps(event.steps))
        return dead_letter_row(DeadLetter.model_validate_json(raw))

    def store(self, topic: str, messages: list[bytes]) -> None:
        table = TABLE_OF[topic]
        rows = self.parsed(topic, messages)
        if not rows:
            return
        fresh = self._fresh(table, rows)
        if fresh:
            try:
                self.warehouse.insert(table, fresh)
            except Exception:
                self.forget_keys()  # part of the insert may be stored: the warehouse knows what
                raise
            self._remember(table, fresh)
            WRITES.labels(table).inc()
        ROWS.labels(table, "stored").inc(len(fresh))
        ROWS.labels(table, "duplicate").inc(len(messages) - len(fresh))

    def _remember(self, table: str, stored: list[dict]) -> None:
        """Stored rows' keys, into the filter of the key table they went to."""
        if not self.remember_keys:
            return
        if table in KEYED:
            self.filters["event_keys"].add([event_key(table, r["tenant"], r["event_id"]) for r in stored])
        elif table == "samples":
            self.filters["sample_latest"].add([sample_key(r) for r in stored])

    def parsed(self, topic: str, messages: list[bytes]) -> dict[tuple[str | None, str], dict]:
        """Each message's row by (tenant, event id), the first of repeats; one that does not
        parse is dead-lettered here."""
        table = TABLE_OF[topic]
        rows: dict[tuple[str | None, str], dict] = {}
        for raw in messages:
            try:
                row = self.to_row(topic, raw)
            except ValidationError as error:
                # Producers validate, so this is a bug or a foreign writer: keep it visible.
                self.warehouse.insert("dead_letters", [dead_letter_row(DeadLetter(
                    event_id=f"sink-{hashlib.sha256(raw).hexdigest()[:32]}", source_topic=topic,
                    reason=f"sink could not parse: {error.errors()[0]['msg']}",
                    payload=raw.decode(errors="replace")))])
                ROWS.labels(table, "malformed").inc()
                continue
            rows.setdefault((row.get("tenant"), row["event_id"]), row)
        return rows


class KeysReloaded(ConsumerRebalanceListener):
    """Partitions given to this sink may have been written by another sink until now: the
    key filters are loaded again before the next batch's check."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None: ...

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.sink.forget_keys()


async def consume(settings: Settings, sink: Sink, stop: asyncio.Event) -> None:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap, group_id=GROUP,
        enable_auto_commit=False, auto_offset_reset="earliest", max_poll_records=2000,
    )
    consumer.subscribe(list(TABLE_OF), listener=KeysReloaded(sink))
    await consumer.start()
    uncommitted: dict[str, int] = {}  # messages stored, by topic, whose offsets are not committed yet
    try:
        while not stop.is_set():
            by_topic = await gather(consumer, settings.warehouse.batch_s)
            for topic, values in by_topic.items():
                await asyncio.to_thread(sink.store, topic, values)
                uncommitted[topic] = uncommitted.get(topic, 0) + len(values)
            if by_topic:
                try:
                    await consumer.commit()
                except KafkaError as error:
                    # The broker (or its store) away mid-commit: the next batch's commit covers
                    # these offsets, and what a restart reads again is dropped as stored.
                    log(logger, "offsets not committed", error=repr(error))
                    continue
                for topic, count in uncommitted.items():
                    STORED_OFFSET.labels(topic).inc(count)
                uncommitted.clear()
    finally:
        await consumer.stop()


async def gather(consumer: AIOKafkaConsumer, batch_s: float, most: int = 5000) -> dict[str, list[bytes]]:
    """Each topic's messages that arrive within `batch_s` of the first (at most `most` in
    all), from every partition: one write per topic, not one per partition and fetch.
    A sample's revisions share a partition, so they keep their order."""
    by_topic: dict[str, list[bytes]] = {}
    deadline, count = None, 0
    while count < most:
        wait_s = 0.2 if deadline is None else deadline - time.monotonic()
        if wait_s <= 0:
            break
        fetched = await consumer.getmany(timeout_ms=int(wait_s * 1000), max_records=most - count)
        if not fetched and deadline is None:
            break  # nothing at all: the caller looks at its stop event
        for tp, messages in fetched.items():
            by_topic.setdefault(tp.topic, []).extend(m.value for m in messages)
            count += len(messages)
        if deadline is None:
            deadline = time.monotonic() + batch_s
    return by_topic


# ClickHouse's DateTime64 holds 1900-2299; the figures concern completions served since 1970.
EPOCH, FAR = datetime(1970, 1, 1, tzinfo=UTC), datetime(2200, 1, 1, tzinfo=UTC)


class FiguresRequest(BaseModel):
    versions: list[VersionName] = Field(min_length=1, max_length=32, description="Policy versions to report.")
    since: AwareDatetime = Field(ge=EPOCH, le=FAR, description="Completions served from this time...")
    until: AwareDatetime = Field(ge=EPOCH, le=FAR, description="...up to this one (late feedback: leave "
                                 "the window time).")
    production_only: bool = Field(True, description="Leave out rollouts (source = rollout).")
    bucket_s: int | None = Field(None, ge=1, le=86_400, description="Also split by the time served, in "
                                 "buckets of this many seconds (a curve per version); none: one row.")


class VersionFigures(BaseModel):
    """What the completions one version served to one tenant earned (latest revisions)."""

    policy_version: str
    tenant: str
    samples: int = Field(description="Completions with a reward.")
    judged: int = Field(description="...of which had an accept-like verdict.")
    accepted: int
    reward_sum: float
    reward_squares: float
    bucket: int | None = Field(None, description="Start of the time bucket served in, Unix seconds (with bucket_s).")


FIGURES_SQL = """SELECT policy_version, tenant, {bucket} toInt64(count()) AS samples,
    toInt64(countIf(a IS NOT NULL)) AS judged, toInt64(sum(ifNull(a, 0))) AS accepted,
    sum(r) AS reward_sum, sum(r * r) AS reward_squares
FROM (SELECT policy_version, tenant, sample_id, argMax(accepted, revision) AS a, argMax(reward, revision) AS r,
             any(served_at) AS served
      FROM samples WHERE policy_version IN ({versions}) AND served_at >= {since} AND served_at < {until}
      {production} GROUP BY policy_version, tenant, sample_id)
GROUP BY policy_version, tenant {by_bucket} ORDER BY policy_version, tenant {by_bucket}"""


def timestamp_literal(t: datetime) -> str:
    return f"toDateTime64({t.timestamp():.3f}, 3, 'UTC')"


class ServingFigures(BaseModel):
    """How one version's answers went, whatever the users thought of them."""

    policy_version: str
    requests: int
    errors: int = Field(description="Answers with a server error (status 500 or more, or an error recorded).")
    p50_ms: float = Field(description="Median latency, milliseconds.")
    p99_ms: float = Field(description="99th percentile latency, milliseconds.")


SERVING_SQL = """SELECT policy_version, toInt64(count()) AS requests,
    toInt64(countIf(status >= 500 OR error IS NOT NULL)) AS errors,
    quantileExact(0.5)(latency_ms) AS p50_ms, quantileExact(0.99)(latency_ms) AS p99_ms
FROM requests FINAL WHERE policy_version IN ({versions}) AND timestamp >= {since} AND timestamp < {until}
GROUP BY policy_version ORDER BY policy_version"""


def window(request: FiguresRequest) -> dict[str, str]:
    """The request's versions and period as SQL literals."""
    return {"versions": ", ".join(quote(v) for v in request.versions),
            "since": timestamp_literal(request.since), "until": timestamp_literal(request.until)}


def figures_sql(request: FiguresRequest) -> str:
    bucket = (f"toUnixTimestamp(toStartOfInterval(toDateTime(served), INTERVAL {request.bucket_s} SECOND)) AS bucket,"
              if request.bucket_s else "")
    return FIGURES_SQL.format(**window(request),
                              production="AND source != 'rollout'" if request.production_only else "",
                              bucket=bucket, by_bucket=", bucket" if request.bucket_s else "")


class SqlRequest(BaseModel):
    sql: str = Field(max_length=100_000, description="One SELECT over liverl's tables.")
    format: Literal["json", "csv", "table"] = "json"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.warehouse = open_warehouse(settings)
        stop = asyncio.Event()
        task = asyncio.create_task(consume(settings, Sink(app.state.warehouse, settings.warehouse.remember_keys), stop))
        app.state.consumer = task
        log(logger, "sink started", backend=settings.warehouse.kind)
        yield
        stop.set()
        await task
        app.state.warehouse.close()

    async def health() -> dict:
        task = app.state.consumer
        if task.done():
            raise HTTPException(503, f"consumer stopped: {task.exception()!r}")
        return {"ok": True}

    app = service_app("liverl analytics sink", settings, health, lifespan)

    @app.post("/figures")
    async def figures(body: FiguresRequest, key: KeyRecord = Depends(require_admin)) -> list[VersionFigures]:
        """Per version and tenant, what its served completions earned: the promotion
        controller's live comparison (admin key; a fixed query, not analyst SQL)."""
        rows = await asyncio.to_thread(query_json, app.state.warehouse, figures_sql(body))
        return [VersionFigures(**row) for row in rows]

    @app.post("/serving-figures")
    async def serving_figures(body: FiguresRequest, key: KeyRecord = Depends(require_admin)) -> list[ServingFigures]:
        """Per version, its answers' error rate and latency: the controller's serving checks
        (admin key; every tenant together, as a quantile does not add up)."""
        rows = await asyncio.to_thread(query_json, app.state.warehouse, SERVING_SQL.format(**window(body)))
        return [ServingFigures(**row) for row in rows]

    @app.post("/sql", response_class=PlainTextResponse)
    async def sql(body: SqlRequest, audit: Audit, key: KeyRecord = Depends(require_key)) -> str:
        """Analysts' SQL (feedback/analyst_sql.py): an admin key reads every tenant, a
        tenant key its own rows; every query is audited."""
        tenant = None if key.role == "admin" else key.tenant
        audit.record(key.key_id, "sql", key.tenant, query=body.sql[:2000])
        try:
            statement = prepare(body.sql, tenant)
        except RefusedQuery as error:
            raise HTTPException(403, str(error)) from None
        try:
            return await asyncio.to_thread(app.state.warehouse.query, statement, FORMATS[body.format])
        except Exception as error:  # ClickHouse's own message is what an analyst needs
            raise HTTPException(400, (str(error).strip().splitlines() or ["query failed"])[0][:500]) from None

    return app


if __name__ == "__main__":
    from liverl.process import serve

    settings = get_settings()
    serve(create_app(settings), settings.host, settings.ports.sink)
