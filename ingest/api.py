"""The ingest + admin API: product teams' feedback in, acknowledged only once on Kafka."""

from __future__ import annotations

import collections
import gc
import json
import math
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import NamedTuple, get_args

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import Response
from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from ingest.schemas import (
    FeedbackBatch,
    IngestItem,
    IngestResponse,
    ItemError,
    ItemForbidden,
    ItemResult,
    KeyRequest,
    describe,
    to_event,
)
from liverl.contracts import Architecture, utcnow
from liverl.http import Audit, read_json, service_app
from liverl.kafka import BatchProducer, encode
from liverl.keys import KeyRecord, require_admin, require_key
from liverl.observability import log, setup_logging
from liverl.ratelimit import TenantRateLimiter
from liverl.settings import Settings, get_settings
from policies.registry import Registry

ITEMS = Counter("liverl_ingest_items_total", "Ingested items by outcome", ["type", "outcome"])
BATCH_SECONDS = Histogram("liverl_ingest_batch_seconds", "Time to acknowledge a batch")
logger = setup_logging("ingest")
ITEM_TYPES = get_args(IngestItem.model_fields["type"].annotation)


class RecentIds:
    """Ids acknowledged lately, so a client retry is answered as a duplicate cheaply.

    Best effort only: the feedback stream and ClickHouse dedupe by event_id for real.
    """

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        # "tenant/id" strings, not tuples: the garbage collector skips strings, and
        # walking 200,000 tuples in every full collection stalled requests.
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._ids

    def add(self, key: str) -> None:
        self._ids[key] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


class ServingArchitecture:
    """The stable policy's architecture, which every trajectory's ids must fit; looked
    up again when the stable version may have changed (at most every `refresh_s`)."""

    def __init__(self, settings: Settings, refresh_s: float = 5.0):
        self.registry = Registry(settings.policies_dir)
        self.refresh_s = refresh_s
        self._checked = 0.0
        self._version: str | None = None
        self._arch: Architecture | None = None

    def get(self) -> Architecture | None:
        if time.monotonic() - self._checked > self.refresh_s:
            self._checked = time.monotonic()
            stable = self.registry.stable()
            if stable and stable.version != self._version:
                config = json.loads((Path(stable.model_dir) / "config.json").read_text())
                self._version, self._arch = stable.version, Architecture.of(config)
        return self._arch


def validated_items(raw: bytes, max_items: int) -> list[tuple[str | None, str, IngestItem | ItemError]]:
    """(id, type, validated item or why not) for each item of a request body; an
    HTTPException when the body as a whole is not a batch."""
    try:
        batch = FeedbackBatch.model_validate_json(raw).batch
    except ValidationError:
        pass  # not all plain, valid feedback: item by item below, each error on its item
    else:
        if len(batch) <= max_items:
            return [(item.id, item.type, item) for item in batch]
    payload = read_json(raw)
    if not isinstance(payload, dict) or not isinstance(payload.get("batch"), list):
        raise HTTPException(422, "batch: expected an object {\"batch\": [...]} with a list")
    if extra := set(payload) - {"batch"}:
        raise HTTPException(422, f"{sorted(extra)[0]}: extra field not permitted")
    if len(payload["batch"]) > max_items:
        raise HTTPException(413, f"batch has {len(payload['batch'])} items; the limit is {max_items}")
    items = []
    for index, raw_item in enumerate(payload["batch"]):
        item_id = raw_item.get("id") if isinstance(raw_item, dict) else None
        item_type = raw_item.get("type") if isinstance(raw_item, dict) else None
        try:
            item: IngestItem | ItemError = IngestItem.model_validate(raw_item)
        except ValidationError as error:
            item = ItemError(describe(error, f"batch.{index}"))
        items.append((item_id if isinstance(item_id, str) else None,
                      item_type if isinstance(item_type, str) and item_type in ITEM_TYPES else "?",
                      item))  # bounded metric labels
    return items


class Send(NamedTuple):
    """An accepted item on its way to the broker: its place among the results, the
    message, the id it is remembered by once acknowledged, and its type (for metrics)."""

    position: int
    message: tuple[str, bytes, bytes]
    seen_id: str
    item_type: str


class Ingestion:
    """Batches onto Kafka: each item checked on its own, and acknowledged only once the
    broker acknowledged it (acks=all)."""

    producer: BatchProducer  # made as the app starts

    def __init__(self, settings: Settings):
        self.limits = settings.ingest
        self.limiter = TenantRateLimiter(self.limits.tenant_events_per_s, self.limits.tenant_events_burst)
        self.architecture = ServingArchitecture(settings)
        self.recent = RecentIds()

    async def batch(self, raw: bytes, caller: KeyRecord, received_at: datetime) -> IngestResponse:
        if len(raw) > self.limits.max_body_bytes:
            raise HTTPException(413, f"body is {len(raw)} bytes; the limit is {self.limits.max_body_bytes}")
        items = validated_items(raw, self.limits.max_batch_items)
        self.limiter.check(caller.tenant, len(items))
        arch = self.architecture.get() if any(t == "trajectory" for _, t, _ in items) else None
        results: list[ItemResult] = []
        outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        sends: list[Send] = []
        in_batch: set[str] = set()
        for item_id, item_type, item in items:
            try:
                if isinstance(item, ItemError):
                    raise item
                seen_id = f"{caller.tenant}/{item.id}"  # tenants are ids: no "/" in them
                if item.id in in_batch or seen_id in self.recent:
                    results.append(ItemResult(id=item.id, status=200, duplicate=True))
                    outcomes[item.type, "duplicate"] += 1
                    continue
                message = self.message(item, caller, received_at, arch)
            except ItemError as error:
                status = 413 if "larger than" in str(error) else error.status
                results.append(ItemResult(id=item_id, status=status, error=str(error)))
                outcomes[item_type, "rejected"] += 1
                continue
            in_batch.add(item.id)
            results.append(ItemResult(id=item.id, status=201))
            sends.append(Send(len(results) - 1, message, seen_id, item.type))
        try:
            await self.acknowledge(sends, results, outcomes)
        finally:
            for (item_type, outcome), n in outcomes.items():
                ITEMS.labels(item_type, outcome).inc(n)
        accepted = sum(r.status < 300 for r in results)
        return IngestResponse(accepted=accepted, rejected=len(results) - accepted, results=results)

    def message(self, item: IngestItem, caller: KeyRecord, received_at: datetime,
                arch: Architecture | None) -> tuple[str, bytes, bytes]:
        """The item as a Kafka message (topic, partition key, value); an ItemError if it may not be sent."""
        if item.type == "trajectory" and "trajectories" not in caller.scopes:
            raise ItemForbidden("type: this key may not send trajectories (they train the shared "
                                "policy: a key needs the 'trajectories' scope)")
        topic, partition_key, event = to_event(item, caller.tenant, received_at, arch)
        value = encode(event)
        if len(value) > self.limits.max_item_bytes:
            raise ItemError(f"item is larger than {self.limits.max_item_bytes} bytes as an event")
        return topic, partition_key.encode(), value

    async def acknowledge(self, sends: list[Send], results: list[ItemResult],
                          outcomes: collections.Counter[tuple[str, str]]) -> None:
        """Send; an item the broker did not acknowledge becomes a 503 and is not remembered
        as seen, so the client's retry is taken as new."""
        failures = await self.producer.send_many([send.message for send in sends])
        for send, failure in zip(sends, failures, strict=True):
            if failure is not None:
                results[send.position] = ItemResult(id=results[send.position].id, status=503,
                                                    error=f"broker did not acknowledge: {failure}")
                outcomes[send.item_type, "unacknowledged"] += 1
            else:
                self.recent.add(send.seen_id)
                outcomes[send.item_type, "accepted"] += 1


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    ingestion = Ingestion(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ingestion.producer = BatchProducer(settings, settings.ingest.delivery_timeout_s)
        # Everything loaded so far lives as long as the process: keep it out of the
        # garbage collector's full passes, which otherwise pause a request for tens of ms.
        gc.freeze()
        yield
        ingestion.producer.close()

    app = service_app("liverl ingest", settings, lifespan=lifespan)
    # The body is read raw (one validation pass for the common batch, item by item
    # otherwise), so its schema is given to the OpenAPI document by hand.
    batch_schema = {"type": "object", "required": ["batch"], "additionalProperties": False,
                    "properties": {"batch": {"type": "array", "maxItems": settings.ingest.max_batch_items,
                                             "items": IngestItem.model_json_schema()}}}

    @app.post("/v1/ingestion", status_code=207, response_model=IngestResponse, openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": batch_schema}}}})
    async def ingest(request: Request, caller: KeyRecord = Depends(require_key)) -> Response:
        started, received_at = time.perf_counter(), utcnow()
        body = await ingestion.batch(await request.body(), caller, received_at)
        BATCH_SECONDS.observe(time.perf_counter() - started)
        # An item the broker did not acknowledge (503) is the client's to send again: when.
        unacknowledged = any(r.status == 503 for r in body.results)
        headers = {"Retry-After": str(math.ceil(settings.ingest.delivery_timeout_s))} if unacknowledged else None
        return Response(body.model_dump_json(), status_code=207, media_type="application/json", headers=headers)

    app.include_router(keys_router)
    return app


# --- admin: keys ------------------------------------------------------------------------
keys_router = APIRouter(prefix="/admin/keys")


@keys_router.post("", status_code=201)
async def create_key(body: KeyRequest, request: Request, audit: Audit,
                     admin: KeyRecord = Depends(require_admin)) -> dict:
    key, record = request.app.state.keys.create(body.tenant, body.role, body.label, body.scopes)
    log(logger, "key created", key_id=record.key_id, tenant=record.tenant, by=admin.key_id)
    audit.record(admin.key_id, "keys.create", record.tenant, key_id=record.key_id, role=record.role,
                 scopes=record.scopes)
    return {"key": key, **record.model_dump(mode="json")}


@keys_router.get("")
async def list_keys(request: Request, admin: KeyRecord = Depends(require_admin)) -> list[dict]:
    return [r.model_dump(mode="json") for r in request.app.state.keys.list()]


@keys_router.delete("/{key_id}")
async def revoke_key(key_id: str, request: Request, audit: Audit,
                     admin: KeyRecord = Depends(require_admin)) -> dict:
    try:
        record = request.app.state.keys.revoke(key_id)
    except KeyError as error:
        raise HTTPException(404, str(error)) from None
    log(logger, "key revoked", key_id=key_id, by=admin.key_id)
    audit.record(admin.key_id, "keys.revoke", record.tenant, key_id=key_id)
    return record.model_dump(mode="json")


if __name__ == "__main__":
    from liverl.process import serve

    settings = get_settings()
    serve(create_app(settings), settings.host, settings.ports.api)
