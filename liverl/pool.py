"""The replica pool: which vLLM replicas exist, what each serves, whether it takes traffic.

The pool lives in one small JSON file (`run/replicas.json`) written by whoever changes
it (`liverl up`, a swap) and re-read by the gateway when it changes, so routing
survives a gateway restart and a swap needs no extra control channel. Serving, sync,
the promotion controller and the CLI all read it, so it lives here, in the shared core.
"""

from __future__ import annotations

import fcntl
import functools
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from pydantic import BaseModel, Field

from liverl.settings import Settings

SERVED_MODEL_NAME = "liverl-policy"
ROLLOUT = "rollout"  # the alias of a replica lent to rollouts: no production request reaches it
UNIX = "unix:"


class Replica(BaseModel):
    name: str
    url: str
    policy_version: str
    model_dir: str
    enabled: bool = Field(True, description="False while draining or being swapped.")
    pid: int | None = None
    alias: str | None = Field(None, description="Serves only requests naming this team alias (`x-liverl-alias`), "
                              "and no swap touches it; None: general traffic, stable and canary.")


class Pool(BaseModel):
    replicas: list[Replica] = Field(default_factory=list)
    aliases: dict[str, str] = Field(default_factory=dict, description="Alias -> version: `stable`, and "
                                    "`canary` while one is judged (the gateway gives it its traffic share).")
    starting: list[Replica] = Field(default_factory=list, description="Replicas a blue/green swap launched and "
                                    "has not verified yet: no traffic reaches them, and `liverl down` stops them.")

    @property
    def general(self) -> list[Replica]:
        """The replicas of general traffic, which swaps move between stable and canary."""
        return [r for r in self.replicas if r.alias is None]

    @property
    def lent(self) -> list[Replica]:
        """The replicas lent to rollouts (the capacity scheduler's, `serving/capacity.py`)."""
        return [r for r in self.replicas if r.alias == ROLLOUT]

    def get(self, name: str) -> Replica:
        for replica in self.replicas:
            if replica.name == name:
                return replica
        raise KeyError(f"no replica named {name!r}")


def pool_file(settings: Settings) -> Path:
    return settings.run_dir / "replicas.json"


def read_pool(settings: Settings) -> Pool:
    path = pool_file(settings)
    return Pool.model_validate_json(path.read_text()) if path.exists() else Pool()


@contextmanager
def exclusive(lock: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive lock across processes (released when the holder exits, however it exits).
    With `wait=False` it yields False at once if another holds it."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True


@contextmanager
def edit_pool(settings: Settings) -> Iterator[Pool]:
    """Read, change and write the pool under an exclusive lock: the controller's swaps, the
    capacity scheduler and the CLI change it from different processes, and a change made
    between another's read and write must not be lost."""
    with exclusive(pool_file(settings).with_suffix(".lock")):
        pool = read_pool(settings)
        yield pool
        write_pool(settings, pool)


@contextmanager
def replica_lock(settings: Settings, name: str, wait: bool = True) -> Iterator[bool]:
    """One operation at a time on a replica, across processes: the capacity scheduler's
    lends, refreshes and take-backs and the promotion controller's swaps each hold it
    from their last look at the replica to their last write, and look again once they
    hold it (what they decided on may have changed while they waited). With `wait=False`
    it yields False at once if another holds it."""
    with exclusive(settings.run_dir / "locks" / f"{name}.lock", wait) as held:
        yield held


_promotion = threading.RLock()  # the threads of one process; the file lock, the processes
_promotion_depth = threading.local()


@contextmanager
def promotion_lock(settings: Settings, wait: bool = True) -> Iterator[bool]:
    """One change of what stable or a canary is at a time, across threads and processes
    (the controller's loop, its admin API, a CLI or a test with a Promoter): a rollback's
    first pass puts replicas on the restored version before the registry names it, and an
    idle controller looking then would put them back. Reentrant in a thread (a finish that
    aborts); with `wait=False` yields False at once if another holds it."""
    if not _promotion.acquire(blocking=wait):
        yield False
        return
    handle = None
    try:
        depth = getattr(_promotion_depth, "value", 0)
        if depth == 0:
            path = settings.run_dir / "locks" / "promotion.lock"
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
        _promotion_depth.value = depth + 1
        try:
            yield True
        finally:
            _promotion_depth.value = depth
    finally:
        if handle is not None:
            handle.close()  # releases the file lock
        _promotion.release()


def write_pool(settings: Settings, pool: Pool) -> None:
    path = pool_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(pool.model_dump_json(indent=2))
    tmp.replace(path)  # atomic: the gateway never reads half a file


def set_aliases(settings: Settings, **aliases: str | None) -> Pool:
    """Point aliases at versions (None removes one); the gateway routes by them."""
    with edit_pool(settings) as pool:
        for alias, version in aliases.items():
            if version is None:
                pool.aliases.pop(alias, None)
            else:
                pool.aliases[alias] = version
    return pool


def set_replica(settings: Settings, name: str, **changes: object) -> Replica:
    """Change one replica's record (enabled, alias, version...)."""
    with edit_pool(settings) as pool:
        updated = pool.get(name).model_copy(update=changes)
        pool.replicas = [updated if r.name == name else r for r in pool.replicas]
    return updated


@functools.cache
def replica_tls() -> ssl.SSLContext:
    """One TLS context for every replica client: httpx builds one per client by default,
    loading the CA bundle each time (about 17 ms of CPU), which the gateway's first request
    to a replica and each probe and health check of a swap would pay."""
    return httpx.create_ssl_context()


def replica_client(url: str, timeout: float = 30) -> httpx.Client:
    """An HTTP client to one replica, over its socket or TCP; paths are relative ("/health")."""
    if url.startswith(UNIX):
        return httpx.Client(transport=httpx.HTTPTransport(uds=url[len(UNIX):], verify=replica_tls()),
                            base_url="http://replica", timeout=timeout)
    return httpx.Client(base_url=url, timeout=timeout, verify=replica_tls())


def replica_async_client(url: str, timeout: float) -> httpx.AsyncClient:
    if url.startswith(UNIX):
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=url[len(UNIX):], verify=replica_tls()),
                                 base_url="http://replica", timeout=timeout)
    return httpx.AsyncClient(base_url=url, timeout=timeout, verify=replica_tls())
