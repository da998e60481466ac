"""The embedded broker's store: the part of the S3 API that Tansu uses, kept as files.

Tansu 0.6 keeps topics in memory or in an S3 bucket (its postgres and sqlite engines are
not compiled in), so a durable embedded broker needs an S3-compatible store on local
disk. None worth running ships through PyPI, Debian or npm: s3rver (npm), measured first
(docs/reliability.md), reads every listed object's metadata from disk (a listing of
1,000 objects took 0.9 s, and Tansu lists a partition to fetch from it), writes objects
in place (a kill mid-write leaves a torn `watermark.json`), and fails any listing past
1,000 keys on Node 17+ (its continuation tokens use DES). This store keeps each object as
one file written whole (temporary file, fsync if asked, rename), and an in-memory sorted
index of keys rebuilt from the files at start, so a listing costs what it returns.

Objects: PUT (with If-None-Match: * and If-Match, as Tansu's conditional writes need),
GET, HEAD, DELETE, and ListObjectsV2 (prefix, start-after, continuation-token, delimiter,
max-keys). No authentication: it listens on loopback for the one broker beside it.

It also keeps the log within bounds (app.broker_retention, every `--retention-check-s`),
and refuses new data while its volume has less than `--min-free-bytes` free: a batch,
and the watermark a produce moves first, are answered 507 InsufficientStorage, so the
producer's ack fails (Tansu gives up after its S3 client's retries, about 2 s) before the
produce takes offsets; offset commits and topic metadata still go through, so consumers
move on and retention can free what they read. Once per episode
it POSTs `broker_disk_low` to `promotion.alert_webhook` (read from the settings in its
environment, never a command line). `/health` says how full it is, `/metrics` counts.

    python -m app.broker_store --directory DIR --bucket NAME --port PORT [--fsync]
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from xml.sax.saxutils import escape

import httpx
import typer
import uvicorn
from prometheus_client import Counter, Gauge, make_asgi_app
from sortedcontainers import SortedDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from app.broker_retention import Batch, Pass, Policy, Records, batch_records, moved_watermark, plan
from liverl.observability import log, setup_logging

OBJECTS = "objects"  # DIR/objects/<bucket>/<key>: a key's slashes are folders
XML = "application/xml"
BATCH, WATERMARK = ".batch", "/watermark.json"  # a produce moves its partition's watermark, then adds a batch
MARGIN = 64 << 20  # an episode of low disk ends with free space back above 1.25 x the minimum + 64 MiB
ALERT = "broker_disk_low"

logger = setup_logging("broker-store")
FREE = Gauge("liverl_broker_store_free_bytes", "Free space on the volume of the broker's store")
LOW = Gauge("liverl_broker_store_disk_low", "1 while the store refuses new batches: free space below the minimum")
REFUSED = Counter("liverl_broker_store_refused_writes_total", "Writes refused because the volume was nearly full")
STORED = Gauge("liverl_broker_store_bytes", "Bytes of the objects the broker's store keeps")
DELETED = Counter("liverl_broker_retention_deleted_batches_total", "Batches deleted by retention")
FREED = Counter("liverl_broker_retention_freed_bytes_total", "Bytes of batches deleted by retention")
HELD = Gauge("liverl_broker_retention_held_partitions", "Partitions whose old batches a consumer group has not read")


class Stored:
    """What a listing and a conditional write need to know of an object; its entry in a
    listing is written once, since Tansu lists a partition's every batch on each fetch."""

    __slots__ = ("size", "mtime_ns", "listed")

    def __init__(self, key: str, size: int, mtime_ns: int):
        self.size, self.mtime_ns = size, mtime_ns
        self.listed = (f"<Contents><Key>{escape(key)}</Key><LastModified>{self.modified}</LastModified>"
                       f"<ETag>{escape(self.etag)}</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass>"
                       "</Contents>")

    @property
    def etag(self) -> str:
        # Opaque to clients (S3's is too); changes with every write of the key.
        return f'"{self.mtime_ns:x}-{self.size:x}"'

    @property
    def modified(self) -> str:
        return datetime.fromtimestamp(self.mtime_ns / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class Store:
    def __init__(self, root: Path, fsync: bool, buckets: tuple[str, ...] = ()):
        self.root = root / OBJECTS
        self.fsync = fsync
        for bucket in buckets:
            (self.root / bucket).mkdir(parents=True, exist_ok=True)
        self.buckets: dict[str, SortedDict] = {b.name: self.scan(b) for b in self.root.iterdir()}

    @staticmethod
    def scan(bucket: Path) -> SortedDict:
        index = SortedDict()
        for folder, _, files in os.walk(bucket):
            for name in files:
                path = Path(folder) / name
                if name.startswith(".put-"):  # a write a kill interrupted: never acknowledged
                    path.unlink(missing_ok=True)
                    continue
                stat = path.stat()
                key = path.relative_to(bucket).as_posix()
                index[key] = Stored(key, stat.st_size, stat.st_mtime_ns)
        return index

    def path(self, bucket: str, key: str) -> Path:
        path = (self.root / bucket / key).resolve()
        if not path.is_relative_to((self.root / bucket).resolve()) or not key or key.endswith("/"):
            raise ValueError(f"invalid key {key!r}")
        return path

    def put(self, bucket: str, key: str, body: bytes) -> Stored:
        path = self.path(bucket, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".put-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(body)
                if self.fsync:
                    out.flush()
                    os.fsync(out.fileno())
            os.replace(tmp, path)
        except OSError:  # a full disk, say: the part written is no object
            Path(tmp).unlink(missing_ok=True)
            raise
        stat = path.stat()
        stored = self.buckets[bucket][key] = Stored(key, stat.st_size, stat.st_mtime_ns)
        return stored

    def delete(self, bucket: str, key: str) -> None:
        if self.buckets[bucket].pop(key, None) is not None:
            self.path(bucket, key).unlink(missing_ok=True)

    def read_json(self, bucket: str, key: str) -> dict:
        return json.loads(self.path(bucket, key).read_bytes())

    def plan_retention(self, bucket: str, index: SortedDict, policy: Policy,
                       cache: dict[str, Records | None]) -> Pass:
        """What a retention pass (app.broker_retention) deletes from a bucket of Tansu's,
        planned on a copy of its index, off the event loop. `cache`: what each batch holds
        (batches are never rewritten)."""
        def records(batch: Batch) -> Records | None:
            if batch.key not in cache:
                cache[batch.key] = batch_records(self.path(bucket, batch.key).read_bytes())
            return cache[batch.key]

        return plan(index, policy, time.time(), lambda key: self.read_json(bucket, key), records)

    def apply_retention(self, bucket: str, result: Pass, cache: dict[str, Records | None]) -> None:
        """Delete what the plan said, and tell each partition's watermark its new first
        offset: on the event loop, between two requests, so no write of Tansu's interleaves."""
        for key in result.deleted:
            self.delete(bucket, key)
            cache.pop(key, None)
        for prefix, log_start in result.log_starts.items():
            key = prefix + "watermark.json"
            if key in self.buckets[bucket] and \
                    (moved := moved_watermark(self.path(bucket, key).read_bytes(), log_start)):
                self.put(bucket, key, moved)  # Tansu's next conditional write of it re-reads it first

    def listing(self, bucket: str, prefix: str, after: str, delimiter: str, limit: int):
        """(keys, common prefixes, truncated, the last key or prefix returned), from past
        `after` on (past every key under `after` when it is a common prefix)."""
        keys: list[str] = []
        prefixes: list[str] = []
        past = after if after >= prefix else ""
        under = past if delimiter and past.endswith(delimiter) else None
        for key in self.buckets[bucket].irange(minimum=past or prefix, inclusive=(not past, True)):
            if not key.startswith(prefix):
                break
            if under is not None and key.startswith(under):
                continue
            if delimiter and (cut := key.find(delimiter, len(prefix))) >= 0:
                common = key[:cut + len(delimiter)]
                if prefixes and prefixes[-1] == common:
                    continue
                entry, into = common, prefixes
            else:
                entry, into = key, keys
            if len(keys) + len(prefixes) == limit:
                return keys, prefixes, True, max(keys[-1:] + prefixes[-1:])
            into.append(entry)
        return keys, prefixes, False, None


class Disk:
    """The store's volume: room for new data or not, and on-call told once per episode."""

    def __init__(self, path: Path, min_free_bytes: int, webhook: str | None, timeout_s: float):
        self.path, self.min_free_bytes = path, min_free_bytes
        self.webhook, self.timeout_s = webhook, timeout_s
        self.low = False
        self.alerts: set[asyncio.Task] = set()

    def free(self) -> int:
        free = shutil.disk_usage(self.path).free
        FREE.set(free)
        if self.low and free >= self.min_free_bytes * 1.25 + MARGIN:
            self.low = False
            LOW.set(0)
            log(logger, "disk space recovered: new batches accepted again", free_bytes=free)
        return free

    def refusal(self, key: str, size: int, exists: bool) -> Response | None:
        """The S3 error for a write of new data that would leave less than the minimum free:
        a batch, or a move of a watermark, so that a produce fails before it takes offsets
        (a new topic's first watermark is let through, as commits and metadata are)."""
        new_data = key.endswith(BATCH) or (key.endswith(WATERMARK) and exists)
        if not new_data or (free := self.free()) - size >= self.min_free_bytes:
            return None
        return self.refuse(f"has {free:,} bytes free, below broker.min_free_bytes ({self.min_free_bytes:,})", free)

    def refuse(self, why: str, free: int) -> Response:
        """507, and on-call told if this starts an episode."""
        REFUSED.inc()
        reason = f"the broker's store at {self.path} {why}: new batches are refused until retention or " \
            "an operator frees space"
        if not self.low:
            self.low = True
            LOW.set(1)
            log(logger, "disk low: refusing new batches", free_bytes=free, min_free_bytes=self.min_free_bytes)
            task = asyncio.get_running_loop().create_task(self.alert(reason, free))
            self.alerts.add(task)
            task.add_done_callback(self.alerts.discard)
        return error(507, "InsufficientStorage", reason)

    async def alert(self, reason: str, free: int) -> None:
        """Tell on-call, as the supervisor does (payload in docs/production.md); a webhook
        that fails is logged, not retried."""
        log(logger, "alert", alert=ALERT, reason=reason)
        if self.webhook is None:
            return
        payload = {"event": ALERT, "component": "broker-store", "version": None, "reason": reason,
                   "at": datetime.now(UTC).isoformat(), "actor": "broker-store", "free_bytes": free,
                   "min_free_bytes": self.min_free_bytes}
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                (await client.post(self.webhook, json=payload)).raise_for_status()
        except httpx.HTTPError as failure:
            log(logger, "alert not delivered", alert=ALERT, error=repr(failure))


class Upkeep:
    """What the store does besides storing: retention every `check_s`, the disk watched."""

    DISK_EVERY_S = 5.0

    def __init__(self, store: Store, disk: Disk, policy: Policy, check_s: float):
        self.store, self.disk, self.policy, self.check_s = store, disk, policy, check_s
        self.cache: dict[str, dict[str, Records | None]] = {}  # per bucket: what each batch holds
        self.last: dict = {}
        self.stored_bytes = 0

    async def run(self) -> None:
        due = 0.0
        while True:
            self.disk.free()
            if time.monotonic() >= due:
                await self.retain()
                due = time.monotonic() + self.check_s
            await asyncio.sleep(min(self.check_s, self.DISK_EVERY_S))

    async def retain(self) -> None:
        """A pass over every bucket, planned on a thread (a large log takes a while: the
        store keeps answering); one that fails is logged and tried again next time."""
        started, deleted, freed, held, stored = time.monotonic(), 0, 0, 0, 0
        for bucket in list(self.store.buckets):
            index, cache = self.store.buckets[bucket].copy(), self.cache.setdefault(bucket, {})
            try:
                result = await asyncio.to_thread(self.store.plan_retention, bucket, index, self.policy, cache)
                self.store.apply_retention(bucket, result, cache)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as failure:  # a file not as expected
                log(logger, "retention pass failed", bucket=bucket, error=repr(failure))
                continue
            deleted, freed = deleted + len(result.deleted), freed + result.freed_bytes
            held += result.held_by_groups
            stored += sum(o.size for o in index.values()) - result.freed_bytes
        DELETED.inc(deleted)
        FREED.inc(freed)
        HELD.set(held)
        self.stored_bytes = stored
        STORED.set(stored)
        self.last = {"at": datetime.now(UTC).isoformat(), "deleted_batches": deleted, "freed_bytes": freed,
                     "partitions_held_by_groups": held, "seconds": round(time.monotonic() - started, 3)}
        if deleted:
            log(logger, "retention", **self.last)

    def health(self) -> dict:
        free = self.disk.free()
        return {"ok": True, "free_bytes": free, "min_free_bytes": self.disk.min_free_bytes, "disk_low": self.disk.low,
                "stored_bytes": self.stored_bytes, "last_retention": self.last}


def error(status: int, code: str, message: str) -> Response:
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{escape(message)}</Message></Error>")
    return Response(body, status, media_type=XML)


def create_app(store: Store, upkeep: Upkeep) -> Starlette:
    async def bucket_route(request: Request) -> Response:
        bucket = request.path_params["bucket"]
        if request.method == "PUT":
            store.buckets.setdefault(bucket, SortedDict())
            (store.root / bucket).mkdir(exist_ok=True)
            return Response(status_code=200)
        if bucket not in store.buckets:
            return error(404, "NoSuchBucket", f"no bucket {bucket}")
        if request.method == "HEAD":
            return Response(status_code=200)
        return list_objects(store, bucket, request)

    async def object_route(request: Request) -> Response:
        bucket, key = request.path_params["bucket"], request.path_params["key"]
        if bucket not in store.buckets:
            return error(404, "NoSuchBucket", f"no bucket {bucket}")
        current = store.buckets[bucket].get(key)
        if request.method == "PUT":
            if (request.headers.get("if-none-match") == "*" and current is not None) or \
                    ((match := request.headers.get("if-match")) and (current is None or current.etag != match)):
                return error(412, "PreconditionFailed", f"{key} changed")
            body = await request.body()
            if (refused := upkeep.disk.refusal(key, len(body), current is not None)) is not None:
                return refused
            try:
                stored = store.put(bucket, key, body)
            except OSError as failure:  # the disk filled before the threshold (or it is 0)
                if failure.errno != errno.ENOSPC:
                    raise
                return upkeep.disk.refuse(f"is full ({failure.strerror})", upkeep.disk.free())
            return Response(status_code=200, headers={"ETag": stored.etag})
        if request.method == "DELETE":
            store.delete(bucket, key)
            return Response(status_code=204)
        if current is None:
            return error(404, "NoSuchKey", f"no key {key}")
        headers = {"ETag": current.etag, "Last-Modified": http_date(current.mtime_ns)}
        if request.method == "HEAD":
            return Response(status_code=200, headers=dict(headers, **{"Content-Length": str(current.size)}))
        body = store.path(bucket, key).read_bytes()
        if (ranged := request.headers.get("range")) and ranged.startswith("bytes="):
            start, _, end = ranged[len("bytes="):].partition("-")
            first, last = int(start or 0), int(end) if end else len(body) - 1
            headers["Content-Range"] = f"bytes {first}-{last}/{len(body)}"
            return Response(body[first:last + 1], 206, headers=headers)
        return Response(body, 200, headers=headers, media_type="application/octet-stream")

    async def health(request: Request) -> Response:
        return JSONResponse(upkeep.health())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(upkeep.run())
        yield
        task.cancel()

    return Starlette(lifespan=lifespan, routes=[  # no bucket is named health or metrics (S3 names: no clash here)
        Route("/health", health, methods=["GET"]),
        Mount("/metrics", make_asgi_app()),
        Route("/{bucket}", bucket_route, methods=["GET", "HEAD", "PUT"]),
        Route("/{bucket}/{key:path}", object_route, methods=["GET", "HEAD", "PUT", "DELETE"]),
    ])


def http_date(mtime_ns: int) -> str:
    return datetime.fromtimestamp(mtime_ns / 1e9, UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")


def list_objects(store: Store, bucket: str, request: Request) -> Response:
    """ListObjectsV2; the continuation token is the last key returned (opaque to clients)."""
    q = request.query_params
    prefix, delimiter = q.get("prefix", ""), q.get("delimiter", "")
    after = max(q.get("start-after", ""), q.get("continuation-token", ""))
    keys, prefixes, truncated, last = store.listing(bucket, prefix, after, delimiter, int(q.get("max-keys", 1000)))
    index = store.buckets[bucket]
    contents = "".join(index[k].listed for k in keys)
    common = "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in prefixes)
    token = f"<NextContinuationToken>{escape(last)}</NextContinuationToken>" if truncated and last else ""
    body = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(keys) + len(prefixes)}"
            f"</KeyCount><MaxKeys>{q.get('max-keys', 1000)}</MaxKeys><IsTruncated>{str(truncated).lower()}"
            f"</IsTruncated>{token}{contents}{common}</ListBucketResult>")
    return Response(body, 200, media_type=XML)


def main(directory: Path = typer.Option(..., help="Where the objects are kept."),
         bucket: list[str] = typer.Option([], help="A bucket to create if missing (repeatable)."),
         host: str = typer.Option("127.0.0.1", help="Interface to listen on (loopback: no authentication)."),
         port: int = typer.Option(..., help="Port to listen on."),
         fsync: bool = typer.Option(False, help="fsync each object before acknowledging it."),
         retention_hours: float | None = typer.Option(None, help="Delete read batches older than this."),
         retention_bytes: int | None = typer.Option(None, help="Delete read batches while a partition is bigger."),
         retention_batches: int | None = typer.Option(None, help="Delete read batches while a partition holds "
                                                      "more than this many."),
         retention_check_s: float = typer.Option(60.0, help="How often retention is applied."),
         min_free_bytes: int = typer.Option(0, help="Refuse new batches below this much free space.")) -> None:
    from liverl.settings import get_settings

    store = Store(directory, fsync, tuple(bucket))
    alerts = get_settings().promotion  # the stack's settings, in this process's environment
    disk = Disk(store.root, min_free_bytes, str(alerts.alert_webhook) if alerts.alert_webhook else None,
                alerts.alert_timeout_s)
    policy = Policy(retention_hours * 3600 if retention_hours else None, retention_bytes, retention_batches)
    uvicorn.run(create_app(store, Upkeep(store, disk, policy, retention_check_s)), host=host, port=port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    typer.run(main)
