"""Delta stores: where the trainer publishes deltas and snapshots, and replicas fetch them.

One interface, two backends: a local directory (the embedded default) and an
S3-compatible bucket (production). Each object is stored with an index, `KEY.index.json`:
its size and the blake3 of each `CHUNK_BYTES` chunk. `get` fetches chunk by chunk (in
parallel ranged reads), checks each against the index and fetches a chunk again when it
arrives corrupted or cut short. The index is written last and deleted first, so `list`
shows only complete objects.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import blake3

from liverl.settings import LocalDeltaStore, S3DeltaStore

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
INDEX_SUFFIX = ".index.json"


class StoreError(Exception):
    """An object that is missing, or could not be fetched intact."""


class DeltaStore(ABC):
    """put/get/list/delete of whole files by key ("a/b.delta"); see the module doc."""

    def __init__(self, cache_dir: Path, *, retries: int = 2, threads: int = 4):
        self.cache_dir = Path(cache_dir)
        self.retries = retries  # extra fetches of a chunk that arrives corrupted
        self.threads = threads

    def put(self, key: str, path: Path) -> None:
        """Publish a file under `key`, replacing any object there."""
        _check_key(key)
        with open(path, "rb") as f:
            index = _index(iter(lambda: f.read(CHUNK_BYTES), b""), Path(path).stat().st_size)
        self._delete(key + INDEX_SUFFIX)  # unlisted while the object is being replaced
        self._upload(key, Path(path))
        self._put(key + INDEX_SUFFIX, index)

    def put_bytes(self, key: str, data: bytes) -> None:
        """Publish a small object (a version record) from memory."""
        _check_key(key)
        index = _index((data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)), len(data))
        self._delete(key + INDEX_SUFFIX)
        self._put(key, data)
        self._put(key + INDEX_SUFFIX, index)

    def get_bytes(self, key: str) -> bytes:
        """A small object's content, every chunk verified (see `get`)."""
        size, step, chunks = self._index_of(key)
        return b"".join(self._fetch_chunk(key, i * step, min(step, size - i * step), expected)
                        for i, expected in enumerate(chunks))

    def get(self, key: str, dest: Path | None = None) -> Path:
        """Fetch `key` into `dest` (default: the cache directory), verifying every chunk.
        Raises `StoreError` if the object is missing or a chunk stays corrupted."""
        size, step, chunks = self._index_of(key)
        dest = Path(dest) if dest else self.cache_dir.joinpath(*PurePosixPath(key).parts)
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
        try:
            with open(partial, "wb") as f:
                f.truncate(size)

                def fetch(i: int) -> None:
                    data = self._fetch_chunk(key, i * step, min(step, size - i * step), chunks[i])
                    os.pwrite(f.fileno(), data, i * step)

                with ThreadPoolExecutor(self.threads) as pool:
                    list(pool.map(fetch, range(len(chunks))))
                os.fsync(f.fileno())
            partial.replace(dest)
        finally:
            partial.unlink(missing_ok=True)
        return dest

    def _index_of(self, key: str) -> tuple[int, int, list[str]]:
        """(size, chunk bytes, chunk hashes) of a complete object."""
        _check_key(key)
        try:
            index = json.loads(self._get(key + INDEX_SUFFIX))
        except KeyError:
            raise StoreError(f"no object {key!r} in the store") from None
        size, step = index["size"], index["chunk_bytes"]
        if len(index["chunks"]) != -(-size // step):
            raise StoreError(f"{key}: the index does not cover {size} bytes")
        return size, step, index["chunks"]

    def list(self, prefix: str = "") -> list[str]:
        """Keys of the complete objects under `prefix`, sorted."""
        return sorted(k.removesuffix(INDEX_SUFFIX) for k in self._keys(prefix) if k.endswith(INDEX_SUFFIX))

    def delete(self, key: str) -> None:
        _check_key(key)
        self._delete(key + INDEX_SUFFIX)
        self._delete(key)

    def _fetch_chunk(self, key: str, start: int, length: int, expected: str) -> bytes:
        for attempt in range(1 + self.retries):
            data = self._get_range(key, start, length)
            if len(data) == length and blake3.blake3(data).hexdigest() == expected:
                return data
            log.warning("%s: chunk at byte %d arrived %s (fetch %d); fetching it again", key, start,
                        "short" if len(data) != length else "corrupted", attempt + 1)
        raise StoreError(f"{key}: chunk at byte {start} is corrupted in the store "
                         f"({1 + self.retries} fetches failed)")

    # The backend's primitives.
    @abstractmethod
    def _upload(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def _put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def _get(self, key: str) -> bytes:
        """The whole object; KeyError if there is none."""

    @abstractmethod
    def _get_range(self, key: str, start: int, length: int) -> bytes: ...

    @abstractmethod
    def _keys(self, prefix: str) -> Iterable[str]: ...

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Remove the object if it exists."""


class LocalStore(DeltaStore):
    """Objects as files under a directory; writes are atomic renames."""

    def __init__(self, root: Path, cache_dir: Path, **options):
        super().__init__(cache_dir, **options)
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*PurePosixPath(key).parts)

    def _upload(self, key: str, path: Path) -> None:
        self._atomically(key, lambda partial: shutil.copyfile(path, partial))

    def _put(self, key: str, data: bytes) -> None:
        self._atomically(key, lambda partial: partial.write_bytes(data))

    def _atomically(self, key: str, write) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
        try:
            write(partial)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)

    def _get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        with open(self._path(key), "rb") as f:
            return os.pread(f.fileno(), length, start)

    def _keys(self, prefix: str) -> Iterable[str]:
        if not self.root.is_dir():
            return []
        keys = (p.relative_to(self.root).as_posix() for p in self.root.rglob("*")
                if p.is_file() and ".partial-" not in p.name)
        return [k for k in keys if k.startswith(prefix)]

    def _delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class S3Store(DeltaStore):
    """Objects in an S3-compatible bucket (AWS, MinIO, Ceph...), under `prefix`."""

    def __init__(self, config: S3DeltaStore, cache_dir: Path, **options):
        import boto3
        from botocore.config import Config

        super().__init__(cache_dir, **options)
        self.bucket, self.prefix = config.bucket, config.prefix
        secret = config.secret_access_key.get_secret_value() if config.secret_access_key else None
        self.client = boto3.client(
            "s3", endpoint_url=config.endpoint_url,
            aws_access_key_id=config.access_key_id, aws_secret_access_key=secret,
            region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            config=Config(max_pool_connections=max(10, self.threads)))

    def _upload(self, key: str, path: Path) -> None:
        self.client.upload_file(str(path), self.bucket, self.prefix + key)  # multipart when large

    def _put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def _get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            raise KeyError(key) from None

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        answer = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key,
                                        Range=f"bytes={start}-{start + length - 1}")
        return answer["Body"].read()

    def _keys(self, prefix: str) -> Iterable[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix)
        return [o["Key"].removeprefix(self.prefix) for page in pages for o in page.get("Contents", [])]

    def _delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key)


def open_store(config: LocalDeltaStore | S3DeltaStore, data_dir: Path, **options) -> DeltaStore:
    """The store the settings' `delta_store` describes; fetched objects go under
    `data_dir/cache/deltas`."""
    cache = Path(data_dir) / "cache" / "deltas"
    if isinstance(config, LocalDeltaStore):
        return LocalStore(Path(data_dir) / config.subdir, cache, **options)
    return S3Store(config, cache, **options)


def _index(chunks: Iterable[bytes], size: int) -> bytes:
    hashes = [blake3.blake3(chunk).hexdigest() for chunk in chunks]
    return json.dumps({"size": size, "chunk_bytes": CHUNK_BYTES, "chunks": hashes}).encode()


def _check_key(key: str) -> None:
    parts = PurePosixPath(key).parts
    if not parts or key.startswith("/") or ".." in parts or key.endswith(INDEX_SUFFIX):
        raise ValueError(f"invalid store key {key!r}")
