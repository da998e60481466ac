"""An item the broker never acknowledged is answered 503, not 201, and is not remembered
as seen: the client's retry is taken as new, so nothing is lost. The broker here is a
port nobody listens on (a real broker cannot be made to drop acks on demand)."""

from __future__ import annotations

import socket

from fastapi.testclient import TestClient
from helpers import item

from ingest.api import create_app
from liverl.keys import KeyStore
from liverl.settings import EmbeddedBroker, IngestConfig, Settings


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unacknowledged_items_get_503_and_their_retry_is_not_a_duplicate(tmp_path):
    settings = Settings(data_dir=tmp_path, broker=EmbeddedBroker(port=unused_port()),
                        ingest=IngestConfig(delivery_timeout_s=1.0))
    key, _ = KeyStore(settings.keys_file).create("acme", "tenant", "test")
    batch = {"batch": [item("evt-lost-1", {"kind": "accept", "completion_id": "cmpl-1"}),
                       item("evt-lost-2", {"kind": "thumbs", "completion_id": "cmpl-2", "up": True})]}
    with TestClient(create_app(settings)) as api:
        for attempt in range(2):
            response = api.post("/v1/ingestion", json=batch, headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 207
            assert response.headers["Retry-After"] == "1"  # when to send them again
            body = response.json()
            assert body["accepted"] == 0 and body["rejected"] == 2, attempt
            for result in body["results"]:
                assert result["status"] == 503 and not result["duplicate"]
                assert result["error"].startswith("broker did not acknowledge")
