"""Analyst SQL: a key is needed, a tenant key reads its own rows only however the query is
written, nothing outside liverl's tables is reachable, and every query is bounded."""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
from helpers import item, sql, wait_for

from feedback.analyst_sql import RefusedQuery, prepare
from feedback.warehouse import SCHEMA, ChdbBackend
from liverl.keys import KeyStore

REFUSED = {
    "a host file": "SELECT * FROM file('/etc/passwd', 'LineAsString')",
    "the keys file": "SELECT * FROM file('{data_dir}/dev-keys.json', 'LineAsString')",
    "a URL": "SELECT * FROM url('http://127.0.0.1:9/x', 'CSV', 'a String')",
    "s3": "SELECT * FROM s3('http://127.0.0.1:9/b/k', 'CSV')",
    "another host": "SELECT * FROM remote('127.0.0.1:9000', system.one)",
    "a cluster": "SELECT * FROM cluster('default', system.one)",
    "the shell": "SELECT * FROM executable('ls', 'TSV', 'a String')",
    "input": "SELECT * FROM input('a String')",
    "a dictionary": "SELECT dictGet('d', 'a', toUInt64(1))",
    "a table function in a subquery": "SELECT count() FROM samples WHERE tenant IN (SELECT * FROM file('x', 'CSV'))",
    "system tables": "SELECT * FROM system.tables",
    "another database": "SELECT * FROM default.samples",
    "settings in the query": "SELECT count() FROM samples SETTINGS max_execution_time = 1000",
    "a format": "SELECT count() FROM samples FORMAT TSV",
    "two statements": "SELECT 1; SELECT 2",
    "a write": "INSERT INTO samples (event_id) VALUES ('x')",
    "DDL": "DROP TABLE samples",
    "SHOW": "SHOW TABLES",
    "sleep": "SELECT sleepEachRow(3) FROM samples",
    "an unknown function": "SELECT someFunctionNobodyAllowed(1)",
    "text that does not tokenize": "A $c Hy",  # found by the API fuzzer: a 500 before
    "a lone surrogate": "SELECT '\ud817' FROM samples",  # JSON carries it; no engine reads it
}


@pytest.mark.parametrize("shape", REFUSED)
def test_what_cannot_be_resolved_to_liverls_tables_and_functions_is_refused(shape):
    with pytest.raises(RefusedQuery):
        prepare(REFUSED[shape].format(data_dir="/x"), "dev")
    with pytest.raises(RefusedQuery):  # for admin keys too
        prepare(REFUSED[shape].format(data_dir="/x"), None)


def test_chdb_honours_the_time_limit_the_query_carries():
    warehouse = ChdbBackend(Path(tempfile.mkdtemp()))
    for statement in SCHEMA:
        warehouse.command(statement)
    started = time.monotonic()
    with pytest.raises(Exception, match="TIMEOUT_EXCEEDED|Timeout exceeded"):
        warehouse.query("SELECT sum(number) FROM numbers(100000000000) SETTINGS max_execution_time = 1", "JSON")
    assert time.monotonic() - started < 5
    assert "max_execution_time = 5" in prepare("SELECT 1", None)


SHAPES = {  # every way a tenant might reach another tenant's rows
    "plain": "SELECT DISTINCT tenant FROM feedback_events",
    "qualified": "SELECT DISTINCT tenant FROM liverl.feedback_events",
    "subquery": "SELECT DISTINCT tenant FROM (SELECT tenant FROM feedback_events WHERE 1 = 1)",
    "filter for the other": "SELECT DISTINCT tenant FROM feedback_events WHERE tenant != 'dev' OR 1 = 1",
    "join": "SELECT DISTINCT b.tenant AS tenant FROM feedback_events a JOIN feedback_events b ON 1 = 1",
    "union": "SELECT tenant FROM feedback_events UNION ALL SELECT tenant FROM requests",
    "cte": "WITH x AS (SELECT tenant FROM feedback_events) SELECT DISTINCT tenant FROM x",
    "in subquery": "SELECT DISTINCT tenant FROM feedback_events "
                   "WHERE event_id IN (SELECT event_id FROM feedback_events)",
    "alias named like another table": "SELECT DISTINCT samples.tenant AS tenant FROM feedback_events AS samples",
    "dead letters": "SELECT DISTINCT tenant FROM dead_letters",
    "rollup": "SELECT DISTINCT tenant FROM version_hourly",
    "final": "SELECT DISTINCT s.tenant AS tenant FROM samples AS s FINAL",
}


@pytest.fixture(scope="module")
def two_tenants(settings, api):
    """dev and a second tenant, each with feedback and dead letters in ClickHouse."""
    other = f"globex{uuid.uuid4().hex[:6]}"
    other_key, _ = KeyStore(settings.keys_file).create(other)
    marker = uuid.uuid4().hex
    batch = {"batch": [item(f"sql-{marker}-{i}", {"kind": "accept", "completion_id": f"nope-{marker}"})
                       for i in range(3)]}
    api.post("/v1/ingestion", json=batch)
    httpx.post(settings.url(settings.ports.api) + "/v1/ingestion", json=batch,
               headers={"Authorization": f"Bearer {other_key}"})
    wait_for(lambda: len(sql(settings, f"SELECT DISTINCT tenant FROM feedback_events WHERE "
                                       f"position(event_id, '{marker}') > 0")) == 2, timeout=30)
    return other, other_key


def query(settings, key: str | None, text: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(settings.url(settings.ports.sink) + "/sql", json={"sql": text, "format": "json"},
                      headers=headers, timeout=30)


def test_no_key_no_sql(settings, stack):
    assert query(settings, None, "SELECT 1").status_code == 401
    assert query(settings, "lrl_tnt_not-a-key", "SELECT 1").status_code == 401


@pytest.mark.parametrize("shape", SHAPES)
def test_a_tenant_key_sees_only_its_tenant_however_the_query_is_written(settings, dev_keys, two_tenants, shape):
    response = query(settings, dev_keys["tenant_key"], SHAPES[shape])
    assert response.status_code == 200, response.text
    assert {r["tenant"] for r in response.json()["data"]} <= {"dev"}
    other, other_key = two_tenants
    theirs = query(settings, other_key, SHAPES[shape])
    assert {r["tenant"] for r in theirs.json()["data"]} <= {other}


def test_an_admin_key_sees_every_tenant(settings, two_tenants):
    other, _ = two_tenants
    tenants = {r["tenant"] for r in sql(settings, "SELECT DISTINCT tenant FROM feedback_events")}
    assert {"dev", other} <= tenants


@pytest.mark.parametrize("shape", ["a host file", "the keys file", "a URL", "system tables", "two statements",
                                   "settings in the query", "a format"])
def test_refused_over_http_quickly_and_for_every_key(settings, dev_keys, shape):
    text = REFUSED[shape].format(data_dir=settings.data_dir)
    for key in (dev_keys["tenant_key"], dev_keys["admin_key"]):
        started = time.monotonic()
        response = query(settings, key, text)
        assert response.status_code == 403 and response.json()["detail"], response.text
        assert time.monotonic() - started < 5
        assert "root:" not in response.text and "lrl_" not in response.text


def test_policy_versions_without_their_metrics_for_tenants(settings, dev_keys):
    rows = query(settings, dev_keys["tenant_key"], "SELECT * FROM policy_versions LIMIT 1").json()
    assert "metrics" not in [c["name"] for c in rows["meta"]]
    assert query(settings, dev_keys["tenant_key"], "SELECT metrics FROM policy_versions").status_code == 400
