"""The analytics schema and its two backends: chdb embedded, clickhouse-connect server.

One schema serves both. Every table is a ReplacingMergeTree keyed by its event id, so
a redelivered event is harmless; the sink also skips ids already stored so that the
hourly rollup (fed by a materialized view at insert time) counts each event once. The
big tables' ids are kept in key-value tables (event_keys, sample_latest; filled by
materialized views), so that check costs per id looked up, not per row stored.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Protocol

from liverl.settings import ChdbWarehouse, ClickHouseServer, Settings

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS feedback_events (
        event_id String, tenant LowCardinality(String), timestamp DateTime64(3, 'UTC'),
        received_at DateTime64(3, 'UTC'), completion_id String, kind LowCardinality(String),
        value Nullable(Float64), payload String
    ) ENGINE = ReplacingMergeTree PARTITION BY toYYYYMM(timestamp)
    ORDER BY (tenant, completion_id, event_id)""",
    """CREATE TABLE IF NOT EXISTS trajectories (
        event_id String, tenant LowCardinality(String), timestamp DateTime64(3, 'UTC'),
        completion_id String, group_id Nullable(String), policy_version LowCardinality(String),
        replica LowCardinality(String), source LowCardinality(String),
        prompt_tokens UInt32, completion_tokens UInt32, finish_reason LowCardinality(String),
        latency_ms Nullable(Float64), has_routed_experts UInt8,
        prompt_text String, completion_text String, payload String
    ) ENGINE = ReplacingMergeTree PARTITION BY toYYYYMM(timestamp)
    ORDER BY (tenant, policy_version, event_id)""",
    """CREATE TABLE IF NOT EXISTS samples (
        event_id String, sample_id String, revision UInt32, tenant LowCardinality(String),
        timestamp DateTime64(3, 'UTC'), served_at DateTime64(3, 'UTC'),
        policy_version LowCardinality(String), reward Float64,
        reward_source LowCardinality(String), reward_fn_version LowCardinality(String),
        accepted Nullable(UInt8), completion_tokens UInt32,
        reward_delta Float64, accepted_delta Int32, judged_delta Int32, count_delta Int32,
        source LowCardinality(String)
    ) ENGINE = ReplacingMergeTree PARTITION BY toYYYYMM(timestamp)
    ORDER BY (tenant, policy_version, event_id)""",
    # Stores made before samples said where their trajectory came from: all production.
    "ALTER TABLE samples ADD COLUMN IF NOT EXISTS source LowCardinality(String) DEFAULT 'gateway'",
    """CREATE TABLE IF NOT EXISTS requests (
        event_id String, tenant LowCardinality(String), timestamp DateTime64(3, 'UTC'),
        completion_id Nullable(String), policy_version LowCardinality(String),
        replica LowCardinality(String), endpoint LowCardinality(String), status UInt16,
        error Nullable(String), latency_ms Float64, stream UInt8
    ) ENGINE = ReplacingMergeTree PARTITION BY toYYYYMM(timestamp)
    ORDER BY (tenant, policy_version, event_id)""",
    """CREATE TABLE IF NOT EXISTS dead_letters (
        event_id String, timestamp DateTime64(3, 'UTC'), source_topic LowCardinality(String),
        reason String, tenant Nullable(String), payload String
    ) ENGINE = ReplacingMergeTree PARTITION BY toYYYYMM(timestamp) ORDER BY event_id""",
    """CREATE TABLE IF NOT EXISTS policy_versions (
        event_id String, version String, parent Nullable(String), created_at DateTime64(3, 'UTC'),
        updated_at DateTime64(3, 'UTC'), state LowCardinality(String),
        content_hash String, metrics String
    ) ENGINE = ReplacingMergeTree(updated_at) ORDER BY version""",  # latest state per version
    """CREATE TABLE IF NOT EXISTS capacity_events (
        event_id String, timestamp DateTime64(3, 'UTC'), action LowCardinality(String), replica String,
        policy_version String, load Float64, tokens_per_s Nullable(Float64), why String, seconds Float64,
        bound_s Nullable(Float64), aborted_requests Nullable(Int64), error Nullable(String), steps String
    ) ENGINE = ReplacingMergeTree ORDER BY (timestamp, event_id)""",
    # Stores made before events said where a take-back's time went (JSON of seconds per step).
    "ALTER TABLE capacity_events ADD COLUMN IF NOT EXISTS steps String DEFAULT '{}'",
    # ... and before they had the production tokens/s beside the load, and a take-back its bound.
    "ALTER TABLE capacity_events ADD COLUMN IF NOT EXISTS tokens_per_s Nullable(Float64)",
    "ALTER TABLE capacity_events ADD COLUMN IF NOT EXISTS bound_s Nullable(Float64)",
    # Per version, hour and source (gateway, sdk, rollout). The *_delta columns make
    # revisions exact: a corrected sample adds (new reward - old reward) and no extra count.
    """CREATE TABLE IF NOT EXISTS version_hourly (
        tenant LowCardinality(String), policy_version LowCardinality(String),
        hour DateTime('UTC'), samples Int64, reward_sum Float64, accepted Int64, judged Int64,
        source LowCardinality(String)
    ) ENGINE = SummingMergeTree ORDER BY (tenant, policy_version, hour, source)""",
    # A rollup made before it had a source gets one (its rows: '', all production); a new
    # key column may have no default, hence '' rather than 'gateway'.
    """ALTER TABLE version_hourly ADD COLUMN IF NOT EXISTS source LowCardinality(String),
        MODIFY ORDER BY (tenant, policy_version, hour, source)""",
    "DROP VIEW IF EXISTS version_hourly_mv",  # the view before the rollup had a source
    """CREATE MATERIALIZED VIEW IF NOT EXISTS version_hourly_source_mv TO version_hourly AS
    SELECT tenant, policy_version, toStartOfHour(served_at) AS hour, source,
           toInt64(sum(count_delta)) AS samples, sum(reward_delta) AS reward_sum,
           toInt64(sum(accepted_delta)) AS accepted, toInt64(sum(judged_delta)) AS judged
    FROM samples GROUP BY tenant, policy_version, hour, source""",
]

# The sink's duplicate checks are point lookups in key-value tables (ClickHouse's
# EmbeddedRocksDB, filled by materialized views, so they see every insert): a RocksDB get
# per id, whatever the tables hold and whatever times the events carry. (An index by the
# minute of each event's time read every row of a crowded minute: the soak's load, which
# stamps one time on every event, made each lookup read the whole table.)
# event_keys: '<table>:<tenant>:<event_id>' of every row of the big tables (a tenant's
# name holds no ':'). sample_latest: each sample's latest revision and what a correction
# needs (reward, accepted); a sample's revisions reach the sink in order (one partition,
# one emitter), so a revision at or below the latest stored one is stored.
KEYED = ("feedback_events", "trajectories", "requests")
# argMax of a tuple: argMax of a Nullable column alone skips a NULL accepted.
SAMPLE_LATEST = """SELECT key, newest AS revision, latest.1 AS reward, latest.2 AS accepted
    FROM (SELECT concat(tenant, ':', sample_id) AS key, max(revision) AS newest,
                 argMax(tuple(reward, accepted), revision) AS latest FROM samples GROUP BY tenant, sample_id)"""
SCHEMA += [
    # The index by minute these replace (Nov 27-28): its views would go on costing every insert.
    *(f"DROP VIEW IF EXISTS {table}_ids" for table in KEYED),
    "DROP VIEW IF EXISTS samples_revisions",
    "DROP TABLE IF EXISTS stored_ids",
    "DROP TABLE IF EXISTS sample_revisions",
    "CREATE TABLE IF NOT EXISTS event_keys (key String) ENGINE = EmbeddedRocksDB PRIMARY KEY key",
    *(f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {table}_keys TO event_keys AS
    SELECT concat('{table}:', tenant, ':', event_id) AS key FROM {table}""" for table in KEYED),
    """CREATE TABLE IF NOT EXISTS sample_latest (
        key String, revision UInt32, reward Float64, accepted Nullable(UInt8)
    ) ENGINE = EmbeddedRocksDB PRIMARY KEY key""",
    "CREATE MATERIALIZED VIEW IF NOT EXISTS samples_latest TO sample_latest AS " + SAMPLE_LATEST,
]
# A store made before the key tables has its rows keyed once, when they are created.
BACKFILL = [*(f"INSERT INTO event_keys SELECT concat('{table}:', tenant, ':', event_id) FROM {table}"
              for table in KEYED),
            f"INSERT INTO sample_latest {SAMPLE_LATEST}"]

ROLLUP_SQL = """SELECT policy_version, hour, if(source = '', 'gateway', source) AS source, sum(samples) AS n,
    round(sum(reward_sum) / n, 4) AS mean_reward,
    round(sum(accepted) / nullIf(sum(judged), 0), 4) AS accept_rate
FROM version_hourly GROUP BY policy_version, hour, source ORDER BY hour, policy_version, source"""

FORMATS = {"json": "JSON", "csv": "CSVWithNames", "table": "PrettyCompactMonoBlock"}
class Warehouse(Protocol):
    def command(self, sql: str) -> None: ...

    def query(self, sql: str, fmt: str = "JSON") -> str: ...

    def query_bytes(self, sql: str) -> bytes:
        """A query whose text names its own (binary) output format."""
        ...

    def insert(self, table: str, rows: list[dict]) -> None: ...

    def close(self) -> None: ...


class ChdbBackend:
    """Embedded ClickHouse. A data path can be open in one process only."""

    def __init__(self, path: Path):
        from chdb import session

        path.mkdir(parents=True, exist_ok=True)
        self._session = session.Session(str(path))
        self._lock = threading.Lock()  # one statement at a time through the session
        self.command("CREATE DATABASE IF NOT EXISTS liverl")
        self.command("USE liverl")

    def command(self, sql: str) -> None:
        with self._lock:
            self._session.query(sql)

    def query(self, sql: str, fmt: str = "JSON") -> str:
        with self._lock:
            return self._session.query(sql, fmt).bytes().decode()

    def query_bytes(self, sql: str) -> bytes:
        with self._lock:
            return self._session.query(sql).bytes()

    def insert(self, table: str, rows: list[dict]) -> None:
        body = "\n".join(json.dumps(r, default=str) for r in rows)
        self.command(f"INSERT INTO {table} FORMAT JSONEachRow\n{body}")

    def close(self) -> None:
        self._session.close()


class ServerBackend:
    """A clickhouse-server through clickhouse-connect (production)."""

    def __init__(self, config: ClickHouseServer):
        import clickhouse_connect

        password = config.password.get_secret_value() if config.password else ""
        admin = clickhouse_connect.get_client(
            host=config.host, port=config.port, username=config.username, password=password
        )
        admin.command(f"CREATE DATABASE IF NOT EXISTS {config.database}")
        admin.close()
        self._client = clickhouse_connect.get_client(
            host=config.host, port=config.port, username=config.username,
            password=password, database=config.database,
        )
        self._lock = threading.Lock()

    def command(self, sql: str) -> None:
        with self._lock:
            self._client.command(sql)

    def query(self, sql: str, fmt: str = "JSON") -> str:
        with self._lock:
            return self._client.raw_query(sql, fmt=fmt).decode()

    def query_bytes(self, sql: str) -> bytes:
        with self._lock:
            return self._client.raw_query(sql)

    def insert(self, table: str, rows: list[dict]) -> None:
        body = "\n".join(json.dumps(r, default=str) for r in rows).encode()
        with self._lock:
            self._client.raw_insert(table, insert_block=body, fmt="JSONEachRow")

    def close(self) -> None:
        self._client.close()


def open_warehouse(settings: Settings) -> Warehouse:
    config = settings.warehouse
    backend: Warehouse
    if isinstance(config, ChdbWarehouse):
        backend = ChdbBackend(settings.data_dir / config.subdir)
    else:
        backend = ServerBackend(config)
    migrate(backend)
    return backend


def migrate(warehouse: Warehouse) -> None:
    """Bring a store of any earlier schema to this one, keeping its rows."""
    keyed = query_json(warehouse, "EXISTS TABLE event_keys")[0]["result"]
    for statement in SCHEMA:
        warehouse.command(statement)
    for statement in [] if keyed else BACKFILL:
        warehouse.command(statement)


def query_json(warehouse: Warehouse, sql: str) -> list[dict]:
    return json.loads(warehouse.query(sql, "JSON"))["data"]
