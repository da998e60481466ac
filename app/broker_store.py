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

    python -m app.broker_store --directory DIR --bucket NAME --port PORT [--fsync]
"""

from __future__ import annotations

import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from xml.sax.saxutils import escape

import typer
import uvicorn
from sortedcontainers import SortedDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

OBJECTS = "objects"  # DIR/objects/<bucket>/<key>: a key's slashes are folders
XML = "application/xml"


class Stored:
    """What a listing and a conditional write need to know of an object."""

    __slots__ = ("size", "mtime_ns")

    def __init__(self, size: int, mtime_ns: int):
        self.size, self.mtime_ns = size, mtime_ns

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
                index[path.relative_to(bucket).as_posix()] = Stored(stat.st_size, stat.st_mtime_ns)
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
        with os.fdopen(fd, "wb") as out:
            out.write(body)
            if self.fsync:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
        stat = path.stat()
        stored = self.buckets[bucket][key] = Stored(stat.st_size, stat.st_mtime_ns)
        return stored

    def delete(self, bucket: str, key: str) -> None:
        if self.buckets[bucket].pop(key, None) is not None:
            self.path(bucket, key).unlink(missing_ok=True)

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


def error(status: int, code: str, message: str) -> Response:
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{escape(message)}</Message></Error>")
    return Response(body, status, media_type=XML)


def create_app(store: Store) -> Starlette:
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
            stored = store.put(bucket, key, await request.body())
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

    return Starlette(routes=[
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
    contents = "".join(f"<Contents><Key>{escape(k)}</Key><LastModified>{index[k].modified}</LastModified>"
                       f"<ETag>{escape(index[k].etag)}</ETag><Size>{index[k].size}</Size>"
                       "<StorageClass>STANDARD</StorageClass></Contents>" for k in keys)
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
         fsync: bool = typer.Option(False, help="fsync each object before acknowledging it.")) -> None:
    store = Store(directory, fsync, tuple(bucket))
    uvicorn.run(create_app(store), host=host, port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    typer.run(main)
