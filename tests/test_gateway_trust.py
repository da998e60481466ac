"""The gateway records what it answers, refuses before forwarding what it could not
record, never leaks an in-flight count, and answers hostile input with a 4xx."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers import sql, wait_for
from prometheus_client import REGISTRY, generate_latest

import serving.gateway
import serving.recorder
from liverl.keys import KeyStore
from liverl.settings import EmbeddedBroker, ServingConfig, Settings
from serving.gateway import create_app, replica_session, upstream_error


@pytest.fixture(scope="module")
def gateway(settings, dev_keys):
    with httpx.Client(base_url=settings.url(settings.ports.gateway), timeout=60,
                      headers={"Authorization": f"Bearer {dev_keys['tenant_key']}"}) as client:
        yield client


def inflight(settings) -> list[int]:
    return [r["inflight"] for r in httpx.get(settings.url(settings.ports.gateway) + "/health").json()["replicas"]]


def record_failures() -> float:
    """This process's count of records not recorded (gateways made in the test run here)."""
    text = generate_latest().decode()
    return float(re.search(r"^liverl_gateway_record_failures_total ([0-9.e+]+)$", text, re.M).group(1))


@pytest.mark.parametrize("group_id", ["has space", "a/b", "x" * 129])
def test_a_group_id_that_cannot_be_recorded_is_refused_before_forwarding(settings, gateway, group_id):
    response = gateway.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 2},
                            headers={"x-liverl-group-id": group_id})
    assert response.status_code == 400 and "x-liverl-group-id" in response.json()["error"]["message"]
    assert "x-liverl-completion-id" not in response.headers  # no replica was asked


@pytest.mark.parametrize("field, value", [("logprobs", '"x"'), ("logprobs", "[1]"), ("logprobs", "1e400"),
                                          ("temperature", "1e400"), ("max_tokens", "-1"), ("n", "0"),
                                          ("prompt", '{"a": 1}')])
def test_bad_fields_are_400_naming_them_and_leak_nothing(settings, gateway, field, value):
    body = {k: v for k, v in {"prompt": "x = ", "max_tokens": 2}.items() if k != field}
    raw = json.dumps(body)[:-1] + f', "{field}": {value}}}'  # as sent: 1e400 is no Python float
    response = gateway.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and field in response.json()["error"]["message"], response.text
    assert inflight(settings) == [0] * len(inflight(settings))


def test_deep_json_is_400(gateway):
    response = gateway.post("/v1/chat/completions", content=b"[" * 50_000 + b"]" * 50_000,
                            headers={"content-type": "application/json"})
    assert response.status_code == 400


def test_null_sampling_settings_are_served_and_recorded(settings, gateway):
    response = gateway.post("/v1/completions", json={"prompt": "y = ", "max_tokens": 3,
                                                      "temperature": None, "top_p": None})
    assert response.status_code == 200, response.text
    cid = response.json()["completion_id"]
    query = f"SELECT count() AS n FROM trajectories WHERE completion_id = '{cid}'"
    row = wait_for(lambda: sql(settings, query)[0]["n"])
    assert row == 1


def test_every_choice_is_its_own_completion_in_one_group(settings, gateway):
    response = gateway.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 4, "n": 3})
    assert response.status_code == 200, response.text
    ids = [c["completion_id"] for c in response.json()["choices"]]
    assert len(set(ids)) == 3 and ids[0] == response.json()["completion_id"]
    listed = "', '".join(ids)
    rows = wait_for(lambda: (r := sql(settings, f"SELECT completion_id, group_id, completion_tokens FROM trajectories "
                                                f"WHERE completion_id IN ('{listed}')")) and len(r) == 3 and r)
    assert {r["group_id"] for r in rows} == {ids[0]}
    assert all(r["completion_tokens"] > 0 for r in rows)


def test_a_replicas_non_json_error_keeps_its_status_in_openai_shape():
    response = upstream_error(500, b"Internal Server Error", {})
    assert response.status_code == 500 and b'"message":"Internal Server Error"' in response.body


def test_a_tenant_over_its_rate_gets_429_with_retry_after(tmp_path):
    settings = Settings(data_dir=tmp_path, serving=ServingConfig(tenant_requests_per_s=0.5, tenant_requests_burst=1,
                                                                 no_replica_wait_s=0))
    key, _ = KeyStore(settings.keys_file).create("busy")
    client = TestClient(create_app(settings))  # no replica: the first request is a 503, the next over the limit
    headers = {"Authorization": f"Bearer {key}"}
    assert client.post("/v1/completions", json={"prompt": "x"}, headers=headers).status_code == 503
    limited = client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1


def test_the_spec_describes_both_request_bodies(tmp_path):
    spec = TestClient(create_app(Settings(data_dir=tmp_path))).get("/openapi.json").json()
    for path, field in [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")]:
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert field in schema["required"] and "n" in schema["properties"]
        assert schema["additionalProperties"] is True  # vLLM's own fields are forwarded


def test_a_choice_that_cannot_be_recorded_is_counted_and_named(settings, dev_keys, monkeypatch):
    """A fake replica (a fault no real one produces on demand) answers a NaN logprob: the
    client is served, the trajectory cannot be recorded, and that is counted in the metrics
    and named in the request's row."""
    answer = {"id": "cmpl-fake", "object": "text_completion", "model": "liverl-policy", "prompt_token_ids": [1, 2],
              "choices": [{"index": 0, "text": " 1", "token_ids": [5], "finish_reason": "length",
                           "logprobs": {"tokens": [" 1"], "token_logprobs": [math.nan], "text_offset": [0],
                                        "top_logprobs": None}}]}

    class NaNReplica(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            content = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

    fake = ThreadingHTTPServer(("127.0.0.1", 0), NaNReplica)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    monkeypatch.setattr(serving.gateway, "replica_session",
                        lambda url, timeout: replica_session(f"http://127.0.0.1:{fake.server_port}", timeout))

    async def go() -> httpx.Response:
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gateway") as http:
                return await http.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 1},
                                           headers={"Authorization": f"Bearer {dev_keys['tenant_key']}"})

    before = record_failures()
    try:
        response = asyncio.run(go())  # the lifespan's end waits for the recording
    finally:
        fake.shutdown()
    after = record_failures()
    assert response.status_code == 200 and after == before + 1
    cid = response.json()["completion_id"]
    rows = wait_for(lambda: sql(settings, f"SELECT status, error FROM requests WHERE completion_id = '{cid}'"))
    assert rows[0]["status"] == 200 and "not recorded" in rows[0]["error"] and cid in rows[0]["error"]
    assert sql(settings, f"SELECT count() AS n FROM trajectories WHERE completion_id = '{cid}'")[0]["n"] == 0


def test_a_client_that_hangs_up_mid_stream_still_has_its_completion_recorded(settings, gateway):
    body = {"prompt": "def f(", "max_tokens": 48, "ignore_eos": True, "stream": True}
    with gateway.stream("POST", "/v1/completions", json=body) as response:
        cid = response.headers["x-liverl-completion-id"]
        next(response.iter_lines())  # the first chunk, then hang up
    query = f"SELECT count() AS n FROM trajectories WHERE completion_id = '{cid}'"
    assert wait_for(lambda: sql(settings, query)[0]["n"]) == 1


def test_serving_goes_on_while_the_broker_is_away(settings, dev_keys, monkeypatch):
    """The broker is a port nobody listens on (a real one cannot be made to vanish on
    demand): the gateway starts, answers and refuses as ever, and keeps every record the
    broker never took in its outbox (by the time it stops, after the delivery timeout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        away = settings.model_copy(update={"broker": EmbeddedBroker(port=s.getsockname()[1])})
    monkeypatch.setattr(serving.recorder, "DELIVERY_TIMEOUT_S", 1.0)
    headers = {"Authorization": f"Bearer {dev_keys['tenant_key']}"}
    before = record_failures()
    with TestClient(create_app(away)) as gateway:
        kept = REGISTRY.get_sample_value("liverl_gateway_outbox_records")  # what earlier gateways here left
        served = gateway.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 2}, headers=headers)
        refused = gateway.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 0}, headers=headers)
    assert served.status_code == 200 and refused.status_code == 400
    # the trajectory, its request's row, the refusal's row: kept, none lost
    assert REGISTRY.get_sample_value("liverl_gateway_outbox_records") == kept + 3 and record_failures() == before
