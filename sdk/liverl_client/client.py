"""The product teams' SDK: send feedback from a hot path without waiting on the network.

    from liverl_client import FeedbackClient

    client = FeedbackClient("http://liverl:18080", api_key)
    client.accept(completion_id)
    client.score(completion_id, 0.7)
    client.flush()          # blocks until everything queued so far is acknowledged

Events are batched in the background and retried with exponential backoff; each event
carries an id made once, so a retry can never count twice. Items the API refuses for
good (4xx) are kept in `client.rejected` with the API's reason.

Its own distribution (`liverl-client`, this folder): it needs only httpx, so a product
installs it without the service (torch, faust, vLLM...). Python 3.9 or newer.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import httpx

RETRYABLE = {429, 500, 502, 503, 504}


class FeedbackClient:
    def __init__(self, base_url: str, api_key: str, *, batch_size: int = 100,
                 flush_interval_s: float = 0.5, max_retries: int = 6, timeout_s: float = 10.0):
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s,
                                  headers={"Authorization": f"Bearer {api_key}"})
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.max_retries = max_retries
        self.rejected: list[dict[str, Any]] = []
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="liverl-sdk", daemon=True)
        self._worker.start()

    # --- what products call ---------------------------------------------------------
    def send(self, type: str, body: dict[str, Any], event_id: str | None = None,
             timestamp: datetime | None = None) -> str:
        if self._closed:
            raise RuntimeError("the client is closed")
        event_id = event_id or f"evt-{uuid.uuid4().hex}"
        self._queue.put({"id": event_id, "type": type,
                         "timestamp": (timestamp or datetime.now(timezone.utc)).isoformat(),
                         "body": body})
        return event_id

    def accept(self, completion_id: str, **kw: Any) -> str:
        return self.send("feedback", {"kind": "accept", "completion_id": completion_id}, **kw)

    def reject(self, completion_id: str, **kw: Any) -> str:
        return self.send("feedback", {"kind": "reject", "completion_id": completion_id}, **kw)

    def thumbs(self, completion_id: str, up: bool, **kw: Any) -> str:
        return self.send("feedback", {"kind": "thumbs", "completion_id": completion_id, "up": up}, **kw)

    def score(self, completion_id: str, score: float, lo: float = 0.0, hi: float = 1.0, **kw: Any) -> str:
        return self.send("feedback", {"kind": "score", "completion_id": completion_id,
                                      "score": score, "min": lo, "max": hi}, **kw)

    def edit(self, completion_id: str, corrected_text: str, **kw: Any) -> str:
        return self.send("feedback", {"kind": "edit", "completion_id": completion_id,
                                      "corrected_text": corrected_text}, **kw)

    def outcome(self, completion_id: str, name: str, value: float, **kw: Any) -> str:
        return self.send("outcome", {"completion_id": completion_id, "name": name, "value": value}, **kw)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Block until every event queued before this call is acknowledged or rejected."""
        done = threading.Event()
        self._queue.put({"_flush": done})
        if not done.wait(timeout_s):
            raise TimeoutError("liverl: events still unacknowledged after flush timeout")

    def close(self) -> None:
        self.flush()
        self._closed = True
        self._queue.put(None)
        self._worker.join()
        self._http.close()

    def __enter__(self) -> FeedbackClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the background sender --------------------------------------------------------
    def _run(self) -> None:
        pending: list[dict[str, Any]] = []
        deadline = time.monotonic() + self.flush_interval_s
        while True:
            try:
                item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                item = {}
            if item is None:
                self._post(pending)
                return
            flush = item.pop("_flush", None) if item else None
            if item:
                pending.append(item)
            if flush or len(pending) >= self.batch_size or time.monotonic() >= deadline:
                self._post(pending)
                pending = []
                deadline = time.monotonic() + self.flush_interval_s
            if flush:
                flush.set()

    def _post(self, batch: list[dict[str, Any]]) -> None:
        for attempt in range(self.max_retries + 1):
            if not batch:
                return
            try:
                response = self._http.post("/v1/ingestion", json={"batch": batch})
            except httpx.HTTPError:
                response = None
            if response is not None and response.status_code == 207:
                by_id = {item["id"]: item for item in batch}
                retry = []
                for result in response.json()["results"]:
                    if result["status"] in RETRYABLE:
                        retry.append(by_id[result["id"]])
                    elif result["status"] >= 400:
                        self.rejected.append(dict(result, item=by_id.get(result["id"])))
                batch = retry
            elif response is not None and response.status_code not in RETRYABLE:
                self.rejected.extend({"status": response.status_code, "error": response.text,
                                      "item": item} for item in batch)
                return
            if batch:
                time.sleep(min(0.2 * 2**attempt, 5.0))
        self.rejected.extend({"status": 503, "error": "gave up after retries", "item": i} for i in batch)
