"""What a replica's first user would pay for: a client to it (the gateway makes one for
each replica it first routes to, a swap one for each probe and health check, on the cores
production runs on) and vLLM's first request."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from liverl.pool import Replica, replica_async_client, replica_client
from liverl.settings import Settings
from serving.gateway import upstream_body
from serving.replicas import ReplicaError, wait_replica


def test_replica_clients_load_the_certificate_authorities_once(monkeypatch):
    # httpx builds a TLS context per client by default: loading the CA bundle took 17 ms of
    # CPU each (70 ms the first time), paid by the first request the gateway sent to a replica.
    loads = []
    load = ssl.SSLContext.load_verify_locations

    def counted(self, *args, **kwargs):
        loads.append(args or kwargs)
        return load(self, *args, **kwargs)
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    for url in ("unix:/tmp/replica-0.sock", "http://127.0.0.1:1", "unix:/tmp/replica-1.sock"):
        replica_client(url, timeout=5).close()
        asyncio.run(replica_async_client(url, timeout=5).aclose())
    assert len(loads) <= 1


class FakeReplica(BaseHTTPRequestHandler):
    """Stands in for vLLM to record what liverl asks of a replica it has just started."""
    asked: list = []
    status = 200  # what it answers the first request with

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        FakeReplica.asked.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
        self.send_response(FakeReplica.status)
        self.end_headers()

    def log_message(self, *args):
        pass


def start_fake_replica(tmp_path, status: int) -> None:
    """`wait_replica` on a FakeReplica that answers the first request with `status`."""
    FakeReplica.asked, FakeReplica.status = [], status
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeReplica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    process = subprocess.Popen(["sleep", "30"])
    try:
        replica = Replica(name="replica-0", url=f"http://127.0.0.1:{server.server_port}", policy_version="v0",
                          model_dir="/m")
        wait_replica(Settings(data_dir=tmp_path), replica, process)
    finally:
        process.kill()
        server.shutdown()


def test_a_started_replica_answers_one_request_as_the_gateway_asks_before_it_serves(tmp_path):
    # vLLM's first request with logprobs and token ids took 0.13 s, the next 0.04 s: a
    # replica's first user paid for it.
    start_fake_replica(tmp_path, 200)
    [(path, body)] = FakeReplica.asked
    asked_by_gateway = upstream_body({"prompt": "def", "max_tokens": 2}, chat=False)
    assert path == "/v1/completions" and {k: body[k] for k in ("logprobs", "return_token_ids", "model")} == {
        k: asked_by_gateway[k] for k in ("logprobs", "return_token_ids", "model")}


def test_a_replica_that_refuses_the_gateways_request_never_serves(tmp_path):
    # A vLLM that rejects what the gateway asks every replica for (token ids, logprobs) would
    # fail every user request routed to it: it fails at start instead, saying so.
    with pytest.raises(ReplicaError, match="replica-0: healthy, but its first request was answered 400"):
        start_fake_replica(tmp_path, 400)
