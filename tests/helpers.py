"""Small helpers the integration tests share."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from liverl.keys import admin_headers
from liverl.settings import Settings


def sql(settings: Settings, query: str) -> list[dict]:
    response = httpx.post(settings.url(settings.ports.sink) + "/sql", headers=admin_headers(settings),
                          json={"sql": query, "format": "json"}, timeout=30)
    response.raise_for_status()
    return response.json()["data"]


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.3):
    """Poll until predicate returns something truthy; return it (or fail after timeout)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if result := predicate():
            return result
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


def item(event_id: str, body: dict, type: str = "feedback") -> dict:
    return {"id": event_id, "type": type, "timestamp": "2026-11-22T12:00:00Z", "body": body}
