"""The embedded broker's log has retention, and a full disk is a clear error and an alert,
not silent loss. Each test starts a real Tansu on its store (app.broker_store) alone, as
`liverl up` does, not the session stack.

A full disk cannot be made on demand here: it is injected through the threshold
(`broker.min_free_bytes` set above the volume's free space), which is the store's own
test of a full disk."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from fastapi.testclient import TestClient
from helpers import alert_receiver, item, wait_for

from app.broker import cluster_id, store_health
from app.broker_retention import Batch, Policy, expired, superseded
from app.broker_store import Disk, Store, Upkeep
from app.broker_store import create_app as create_store_app
from app.stack import Launcher
from ingest.api import create_app
from liverl.kafka import ensure_topics
from liverl.keys import KeyStore
from liverl.process import stop_pid
from liverl.settings import EmbeddedBroker, IngestConfig, PromotionConfig, Settings

PORT = 29300 + int(os.environ.get("LIVERL_TEST_PORT_OFFSET", "0"))  # the store: PORT + 1
NEVER_ENOUGH = 1 << 62  # more free space than any volume has: every new batch is refused


@contextlib.contextmanager
def broker_alone(settings: Settings) -> Iterator[str]:
    """Tansu and its store, started and stopped as the stack does; the store's URL."""
    settings.broker_cluster_id = cluster_id(settings)
    launcher = Launcher(settings, say=lambda _: None)
    try:
        launcher.broker()
        yield f"http://127.0.0.1:{settings.broker.effective_store_port}"  # type: ignore[union-attr]
    finally:  # killed after 1 s: a graceful stop waits ~5 s on the store's open connections, and proves nothing here
        for component in reversed(launcher.started):
            stop_pid(component.pid, timeout=1)


def produce_one_by_one(bootstrap: str, topic: str, records: list[tuple[bytes, bytes | None]]) -> None:
    """Each record in a batch of its own, acknowledged before the next."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0})
    for key, value in records:
        producer.produce(topic, value, key)
        assert producer.flush(10) == 0


Read = tuple[int | None, bytes | None, bytes | None]  # offset, key, value


def read_from(bootstrap: str, topic: str, offset: int, want: int) -> list[Read]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "retention-test-reader",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, 0, offset)])
    got: list[Read] = []
    deadline = time.time() + 15
    while len(got) < want and time.time() < deadline:
        if (message := consumer.poll(0.5)) is not None and not message.error():
            got.append((message.offset(), message.key(), message.value()))
    consumer.close()
    return got


def test_retention_moves_the_log_start_past_what_every_group_read_and_keeps_the_changelogs_keys(tmp_path):
    settings = Settings(data_dir=tmp_path, broker=EmbeddedBroker(
        port=PORT, retention_hours=1e-6, retention_check_s=0.3, min_free_bytes=0))  # retention: 3.6 ms
    with broker_alone(settings) as store:
        admin = AdminClient({"bootstrap.servers": settings.bootstrap})
        for future in admin.create_topics([NewTopic("events", 1, 1), NewTopic(
                "table-changelog", 1, 1, config={"cleanup.policy": "compact"})]).values():
            future.result()
        # The group's commit first: retention (every 0.3 s) must never see the batches without it.
        group = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": "slow-reader"})
        group.commit(offsets=[TopicPartition("events", 0, 6)], asynchronous=False)  # it read 0..5
        group.close()
        produce_one_by_one(settings.bootstrap, "events", [(b"k%d" % i, b"v%d" % i) for i in range(10)])
        table = [(b"a", b"1"), (b"b", b"1"), (b"a", b"2"), (b"c", b"1"), (b"b", None), (b"a", b"3")]
        produce_one_by_one(settings.bootstrap, "table-changelog", table)

        earliest = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": "watermarks"})
        # Every batch is past retention at once; those the group has not read stay, pass after pass.
        assert wait_for(lambda: earliest.get_watermark_offsets(TopicPartition("events", 0), timeout=5)[0] == 6,
                        timeout=20)
        passes = httpx.get(f"{store}/health").json()["last_retention"]["at"]
        wait_for(lambda: httpx.get(f"{store}/health").json()["last_retention"]["at"] != passes, timeout=5)
        assert earliest.get_watermark_offsets(TopicPartition("events", 0), timeout=5) == (6, 10)
        earliest.close()
        # A fetch below the log start is answered from it: nothing unread is lost.
        assert read_from(settings.bootstrap, "events", 0, 4) == [(i, b"k%d" % i, b"v%d" % i) for i in range(6, 10)]
        assert read_from(settings.bootstrap, "events", OFFSET_BEGINNING, 4)[0][0] == 6

        # The changelog keeps no age limit: what a table restore reads ends in the same table.
        restored: dict[bytes, bytes] = {}
        for _, key, value in read_from(settings.bootstrap, "table-changelog", OFFSET_BEGINNING, 2):
            restored.pop(key) if value is None else restored.__setitem__(key, value)
        assert restored == {b"a": b"3", b"c": b"1"}
        health = httpx.get(f"{store}/health").json()
        assert health["last_retention"]["partitions_held_by_groups"] == 1
        produce_one_by_one(settings.bootstrap, "events", [(b"k10", b"v10")])  # the broker goes on
        assert read_from(settings.bootstrap, "events", 10, 1) == [(10, b"k10", b"v10")]


def test_a_full_volume_refuses_new_batches_clearly_ingest_answers_503_and_on_call_is_alerted_once(tmp_path):
    alerts, receiver = alert_receiver()
    settings = Settings(
        data_dir=tmp_path, broker=EmbeddedBroker(port=PORT, min_free_bytes=NEVER_ENOUGH),
        ingest=IngestConfig(delivery_timeout_s=20.0),
        promotion=PromotionConfig(alert_webhook=f"http://127.0.0.1:{receiver.server_port}/alert"))
    key, _ = KeyStore(settings.keys_file).create("acme", "tenant", "test")
    try:
        with broker_alone(settings) as store, TestClient(create_app(settings)) as api:
            asyncio.run(ensure_topics(settings))  # topics and commits are small files: still written
            started = time.time()
            response = api.post("/v1/ingestion", json={"batch": [item("evt-full", {"kind": "accept",
                                                                                   "completion_id": "c-1"})]},
                                headers={"Authorization": f"Bearer {key}"})
            assert time.time() - started < 15, "refused at once by the store, not after the delivery timeout"
            assert response.headers["Retry-After"] == "20"
            assert [r["status"] for r in response.json()["results"]] == [503]
            health = store_health(settings)  # what `liverl status` shows
            assert health is not None and health["disk_low"]
            assert health["free_bytes"] < health["min_free_bytes"] == NEVER_ENOUGH
            metrics = {line.split()[0]: float(line.split()[1]) for line in
                       httpx.get(f"{store}/metrics/").text.splitlines() if line.startswith("liverl_")}
            assert metrics["liverl_broker_store_disk_low"] == 1
            assert metrics["liverl_broker_store_refused_writes_total"] > 1  # Tansu's S3 client retried
            wait_for(lambda: alerts, timeout=10)
            time.sleep(0.5)
        assert [a["event"] for a in alerts] == ["broker_disk_low"]  # once for the episode, not per write
        assert "below broker.min_free_bytes" in alerts[0]["reason"] and alerts[0]["component"] == "broker-store"
    finally:
        receiver.shutdown()


def test_each_episode_of_low_disk_alerts_once_and_commits_still_go_through(tmp_path: Path):
    alerts, receiver = alert_receiver()

    async def episodes() -> None:
        disk = Disk(tmp_path, NEVER_ENOUGH, f"http://127.0.0.1:{receiver.server_port}/alert", 5.0)
        batch, watermark = "clusters/c/topics/t/partitions/0000000000/records/00000000000000000007.batch", \
            "clusters/c/topics/t/partitions/0000000000/watermark.json"
        refused = disk.refusal(batch, 100, exists=False)
        assert refused is not None and refused.status_code == 507 and b"InsufficientStorage" in refused.body
        assert disk.refusal(watermark, 40, exists=True) is not None  # a produce moves it first: refused then
        assert disk.refusal(watermark, 40, exists=False) is None  # a new topic's
        assert disk.refusal("clusters/c/groups/consumers/g/offsets/t/partitions/0000000000.json", 60, True) is None
        disk.min_free_bytes = 0  # space freed: the episode ends at the next look
        disk.free()
        assert not disk.low and disk.refusal(batch, 100, exists=False) is None
        disk.min_free_bytes = NEVER_ENOUGH  # a second episode
        assert disk.refusal(batch, 100, exists=False) is not None
        await asyncio.gather(*disk.alerts)

    try:
        asyncio.run(episodes())
        assert [a["event"] for a in alerts] == ["broker_disk_low"] * 2
    finally:
        receiver.shutdown()


def test_a_disk_that_fills_before_the_threshold_is_refused_the_same_way(tmp_path: Path, monkeypatch):
    """A fake: fsync answering ENOSPC (as it does when a disk fills under delayed
    allocation), and a volume with 50 bytes free, stand for a disk full for real, which
    cannot be made on demand. The threshold is 0: only the write itself can fail."""
    alerts, receiver = alert_receiver()
    store = Store(tmp_path, fsync=True, buckets=("tansu",))
    disk = Disk(store.root, 0, f"http://127.0.0.1:{receiver.server_port}/alert", 5.0)

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=50))
    batch = "/tansu/clusters/c/topics/t/partitions/0000000000/records/00000000000000000000.batch"
    try:
        with TestClient(create_store_app(store, Upkeep(store, disk, Policy(None, None), 60.0))) as client:
            for _ in range(2):
                refused = client.put(batch, content=b"x" * 10)
                assert refused.status_code == 507 and "is full (No space left on device)" in refused.text
            assert client.get(batch).status_code == 404
            wait_for(lambda: alerts, timeout=10)
        assert list((tmp_path / "objects").rglob("*")) != [] and not list((tmp_path / "objects").rglob(".put-*"))
        assert [a["event"] for a in alerts] == ["broker_disk_low"]
    finally:
        receiver.shutdown()


def test_retention_rules_size_limit_newest_batch_and_unreadable_batches():
    """The rules on their own: a size or count limit takes the oldest first and never the newest
    batch; a batch that cannot be read (compressed) keeps the tombstones after it."""
    batches = [Batch(f"b{i}", i, 100, mtime_s=1_000.0) for i in range(5)]
    young = Policy(retention_s=3_600, retention_bytes=250)  # nothing is old yet
    assert [b.key for b in expired(batches, young, now_s=1_010.0)] == ["b0", "b1", "b2"]  # 500 -> 200 bytes
    assert [b.key for b in expired(batches, Policy(1.0, None), now_s=9_999.0)] == ["b0", "b1", "b2", "b3"]
    # A count limit takes the oldest while more batches are left than it allows (Tansu lists them all per fetch).
    assert [b.key for b in expired(batches, Policy(3_600, None, retention_batches=2), now_s=1_010.0)] == \
        ["b0", "b1", "b2"]
    assert expired(batches, Policy(3_600, None, retention_batches=5), now_s=1_010.0) == []

    held: dict[str, list[tuple[bytes | None, bool]] | None] = {
        "b0": [(b"a", False)], "b1": None, "b2": [(b"a", False)], "b3": [(b"a", True)], "b4": [(b"z", False)]}
    # b0 is superseded by b2; b2 by the tombstone in b3; the tombstone stays: b1 may hold an older "a".
    assert [b.key for b in superseded(batches, lambda b: held[b.key])] == ["b0", "b2"]
    held["b1"] = [(b"y", False)]  # readable after all: now the tombstone has nothing older left
    assert [b.key for b in superseded(batches, lambda b: held[b.key])] == ["b0", "b2", "b3"]
