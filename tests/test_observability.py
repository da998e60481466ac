"""What the components' logging lets through: their own lines, not a line per HTTP request."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from openai import OpenAI

from liverl.observability import log, setup_logging

COMPLETION = {"id": "c", "object": "text_completion", "created": 0, "model": "policy",
              "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}]}


class Completions(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps(COMPLETION).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # the server's own access lines are not under test
        pass


def test_the_demo_clients_requests_do_not_flood_the_log(capsys):
    """The demo sends thousands of requests through the OpenAI client (httpx, or httpx2 in
    openai 3): at INFO each would be a line of the demo's output, burying the live table."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        logger = setup_logging("demo")
        client = OpenAI(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="k", max_retries=0)
        for _ in range(3):
            assert client.completions.create(model="policy", prompt="hi", max_tokens=1).choices[0].text == "ok"
        log(logger, "day over", requests=3)
    finally:
        server.shutdown()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["msg"] for line in lines] == ["day over"], lines
