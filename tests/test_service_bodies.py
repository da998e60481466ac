"""Every service answers JSON nested too deeply with a 4xx, on every endpoint that takes a
JSON body: never a 500, never a crash (no stack needed: each app is built in-process).

Two depths matter: far beyond what the parser recurses to (100,000 levels), and just
below it, where the body parses and the 422 that echoes it back cannot be encoded; that
second depth depends on the stack under the route, so a window around it is swept."""

from __future__ import annotations

import re
import socket
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from liverl.keys import KeyStore
from liverl.settings import EmbeddedBroker, ServingConfig, Settings

FAR_TOO_DEEP = 100_000
# The parser gives up at the recursion limit less the stack under it (about 40 frames
# in-process); the bodies that parse but whose 422 cannot be encoded are the five or so levels
# below that: a step of 3 meets them.
NEAR_THE_LIMIT = range(sys.getrecursionlimit() - 65, sys.getrecursionlimit() - 15, 3)
PATH_VALUES = {"verb": "pause", "version": "v0", "alias": "team-a", "a": "v0", "b": "v1", "key_id": "k"}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def bodies(depth: int) -> list[bytes]:
    """The nesting alone, and inside the fields the services read their bodies by."""
    deep = nested(depth)
    return [deep, b'{"batch": [' + deep + b"]}",
            b'{"messages": [' + deep + b'], "prompt": ' + deep + b', "reason": ' + deep + b"}"]


def refused(response) -> bool:
    """A 4xx; or, from the ingest API, a multi-status whose every item is a 4xx."""
    if response.status_code == 207:
        return all(400 <= item["status"] < 500 for item in response.json()["results"])
    return 400 <= response.status_code < 500


def json_endpoints(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every route whose documented body is JSON, path parameters filled in."""
    endpoints = []
    for path, methods in app.openapi()["paths"].items():
        for method, operation in methods.items():
            if "application/json" in operation.get("requestBody", {}).get("content", {}):
                filled = re.sub(r"{(\w+)}", lambda m: PATH_VALUES.get(m.group(1), "x"), path)
                endpoints.append((method.upper(), filled))
    return endpoints


def ingest(settings: Settings) -> FastAPI:
    """Run with its lifespan (its producer answers an empty batch without a broker): the
    broker is a port nobody listens on."""
    from ingest.api import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return create_app(settings.model_copy(update={"broker": EmbeddedBroker(port=port)}))


def sink(settings: Settings) -> FastAPI:
    from feedback.sink import create_app

    return create_app(settings)


def gateway(settings: Settings) -> FastAPI:
    from serving.gateway import create_app

    return create_app(settings.model_copy(update={"serving": ServingConfig(no_replica_wait_s=0)}))


def learner(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> FastAPI:
    """The learner's own set-up loads the stable policy's weights: a stand-in takes its
    place (its routes read it only when called, and none of them takes a body)."""
    import learner.service

    monkeypatch.setattr(learner.service, "Learner", lambda settings: SimpleNamespace())
    app, _ = learner.service.create_app(settings)
    return app


def capacity(settings: Settings) -> FastAPI:
    from serving.capacity import Scheduler, create_app

    return create_app(Scheduler(settings))


def controller(settings: Settings) -> FastAPI:
    from promotion.api import create_app
    from promotion.controller import Controller

    return create_app(Controller(settings))


def rollouts(settings: Settings) -> FastAPI:
    from rollouts.worker import RolloutWorker, create_app

    return create_app(RolloutWorker(settings))


def evaluator(settings: Settings) -> FastAPI:
    from rollouts.evaluator import Evaluator, create_app

    return create_app(Evaluator(settings))


SERVICES = {"ingest": ingest, "sink": sink, "gateway": gateway, "capacity": capacity, "controller": controller,
            "rollouts": rollouts, "evaluator": evaluator}
TAKE_JSON = {"ingest": 2, "sink": 3, "gateway": 2, "capacity": 1, "controller": 9}  # how many endpoints
WITH_LIFESPAN = {"ingest"}  # the others' start a broker client, a warehouse or a replica pool


@pytest.mark.parametrize("service", [*SERVICES, "learner"])
def test_every_json_body_nested_too_deeply_is_a_4xx(service, tmp_path, monkeypatch):
    settings = Settings(data_dir=tmp_path)
    admin, _ = KeyStore(settings.keys_file).create("ops", "admin", "test")
    app = learner(settings, monkeypatch) if service == "learner" else SERVICES[service](settings)
    endpoints = json_endpoints(app)
    assert len(endpoints) == TAKE_JSON.get(service, 0), endpoints  # the walk found them all
    headers = {"Authorization": f"Bearer {admin}", "content-type": "application/json"}
    client = TestClient(app, raise_server_exceptions=False)
    answered = {}
    with client if service in WITH_LIFESPAN else nullcontext():
        for method, path in endpoints:
            for depth in [FAR_TOO_DEEP, *NEAR_THE_LIMIT]:
                for body in bodies(depth):
                    response = client.request(method, path, content=body, headers=headers)
                    if not refused(response):
                        answered[method, path, depth, body[:12]] = response.status_code
    assert not answered, answered
