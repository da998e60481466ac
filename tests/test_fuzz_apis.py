"""Schemathesis fuzzes every OpenAPI spec liverl serves, on the shared stack: the ingest API
(its admin routes too), the sink's analyst SQL and the gateway. Whatever it sends: no 5xx,
no hang, and afterwards no request still counted in flight on any replica.

Examples per operation are bounded (FUZZ_EXAMPLES) so the suite keeps its time; a longer
run is `LIVERL_FUZZ_EXAMPLES=500 .venv/bin/pytest tests/test_fuzz_apis.py`.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import not_a_server_error

from liverl.keys import admin_headers

FUZZ_EXAMPLES = int(os.environ.get("LIVERL_FUZZ_EXAMPLES", "15"))
REQUEST_TIMEOUT_S = 30  # past it, a request counts as a hang
fuzz = hypothesis_settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
                           suppress_health_check=list(HealthCheck))


def spec(settings, port: int):
    return schemathesis.openapi.from_url(settings.url(port) + "/openapi.json")


@pytest.fixture(scope="session")
def ingest_spec(settings, stack):
    return spec(settings, settings.ports.api)


@pytest.fixture(scope="session")
def sink_spec(settings, stack):
    return spec(settings, settings.ports.sink)


@pytest.fixture(scope="session")
def gateway_spec(settings, stack):
    # Completions are the slow, expensive part: a handful of tokens each is enough to
    # reach every code path of the gateway's recording.
    return spec(settings, settings.ports.gateway)


def call(case, settings, headers: dict) -> None:
    case.call_and_validate(headers=headers, checks=[not_a_server_error], timeout=REQUEST_TIMEOUT_S)


@schemathesis.pytest.from_fixture("ingest_spec").parametrize()
@fuzz
def test_ingest_and_admin_api(case, settings, stack):
    call(case, settings, admin_headers(settings))


@schemathesis.pytest.from_fixture("sink_spec").parametrize()
@fuzz
def test_sink_sql(case, settings, stack):
    call(case, settings, admin_headers(settings))


@schemathesis.pytest.from_fixture("gateway_spec").parametrize()
@fuzz
def test_gateway(case, settings, dev_keys):
    call(case, settings, {"Authorization": f"Bearer {dev_keys['tenant_key']}"})


def test_nothing_left_in_flight_after_the_fuzzing(settings, stack):
    health = httpx.get(settings.url(settings.ports.gateway) + "/health", timeout=10).json()
    assert health["replicas"] and all(r["inflight"] == 0 for r in health["replicas"]), health
