"""Schemathesis fuzzes every OpenAPI spec liverl serves, on the shared stack: the ingest API
(its admin routes too), the sink's analyst SQL and the gateway. Whatever it sends: no 5xx,
no hang, and afterwards no request still counted in flight on any replica.

Examples per operation are bounded (FUZZ_EXAMPLES) so the suite keeps its time; a longer
run is `LIVERL_FUZZ_EXAMPLES=500 .venv/bin/pytest tests/test_fuzz_apis.py`. (Driven
through hypothesis directly: schemathesis's pytest plugin does not load under pytest 9.)
"""

from __future__ import annotations

import os

import httpx
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import not_a_server_error

from liverl.keys import admin_headers

FUZZ_EXAMPLES = int(os.environ.get("LIVERL_FUZZ_EXAMPLES", "15"))
REQUEST_TIMEOUT_S = 30  # past it, a request counts as a hang


def fuzz(url: str, headers: dict) -> list[str]:
    """Every operation of the spec at `url`, FUZZ_EXAMPLES cases each; the operations fuzzed."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    fuzzed = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @hypothesis_settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case) -> None:
            case.call_and_validate(base_url=url, headers=headers, checks=[not_a_server_error],
                                   timeout=REQUEST_TIMEOUT_S)

        run()
        fuzzed.append(f"{operation.method.upper()} {operation.path}")
    return fuzzed


def test_ingest_and_admin_api(settings, stack):
    # Keys it creates are the fuzzer's own; a key id it makes up matches none of the suite's.
    fuzzed = fuzz(settings.url(settings.ports.api), admin_headers(settings))
    assert "POST /v1/ingestion" in fuzzed and "POST /admin/keys" in fuzzed


def test_sink_sql(settings, stack):
    assert "POST /sql" in fuzz(settings.url(settings.ports.sink), admin_headers(settings))


def test_gateway(settings, dev_keys):
    headers = {"Authorization": f"Bearer {dev_keys['tenant_key']}"}
    assert "POST /v1/completions" in fuzz(settings.url(settings.ports.gateway), headers)


def test_nothing_left_in_flight_after_the_fuzzing(settings, stack):
    health = httpx.get(settings.url(settings.ports.gateway) + "/health", timeout=10).json()
    assert health["replicas"] and all(r["inflight"] == 0 for r in health["replicas"]), health
