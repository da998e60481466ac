"""What the broker did not take is kept on disk, within its bound, and re-published: a
completion served while the broker is away is still learned from once it is back, and
records a killed gateway left behind are sent when the next one starts."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time

from confluent_kafka import Producer
from fastapi.testclient import TestClient
from helpers import sql, wait_for
from prometheus_client import REGISTRY

import serving.recorder
import serving.republisher
from liverl.settings import REPO_ROOT, EmbeddedBroker
from serving.gateway import create_app
from serving.outbox import WAL_LIMIT_BYTES, Outbox
from serving.recorder import Recorder
from serving.republisher import Republisher

TOPIC = "liverl.test"


def dropped() -> float:
    return REGISTRY.get_sample_value("liverl_gateway_outbox_dropped_total") or 0.0


def held() -> float:
    return REGISTRY.get_sample_value("liverl_gateway_outbox_records") or 0.0


def values(outbox: Outbox) -> list[bytes]:
    return [record.value for record in outbox.oldest(1 << 30)]


def test_records_come_back_in_order_and_survive_reopening(tmp_path):
    outbox = Outbox(tmp_path, bound=1 << 20)
    for n in range(5):
        assert outbox.put(TOPIC, f"k{n}".encode(), f"v{n}".encode())
    first, second, *_ = outbox.oldest(1 << 20)
    outbox.remove(second)  # delivered out of order: only that one goes
    outbox.close()
    reopened = Outbox(tmp_path, bound=1 << 20)
    assert values(reopened) == [b"v0", b"v2", b"v3", b"v4"] and reopened.records == 4
    assert reopened.bytes == sum(record.size for record in reopened.oldest(1 << 20))
    assert [r.value for r in reopened.oldest(limit_bytes=1)] == [b"v0"]  # at least one, however large


def test_past_its_bound_a_record_is_dropped_and_counted_and_the_disk_stays_bounded(tmp_path):
    outbox = Outbox(tmp_path, bound=100_000)
    before = dropped()
    assert outbox.put(TOPIC, None, b"x" * 60_000)
    assert not outbox.put(TOPIC, None, b"y" * 50_000)
    assert dropped() == before + 1 and values(outbox) == [b"x" * 60_000]
    for _ in range(400):  # 20 MB through the outbox, never more than 100 kB held
        outbox.remove(outbox.oldest(1)[0])
        assert outbox.put(TOPIC, None, b"z" * 50_000)
    assert outbox.bytes <= 100_000
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("slot-0.db*"))
    assert on_disk < 100_000 + WAL_LIMIT_BYTES + 200_000  # the bound, the WAL between checkpoints, pages' slack


def test_a_record_torn_by_a_kill_is_never_read_back(tmp_path):
    live, copy = tmp_path / "live", tmp_path / "copy"
    outbox = Outbox(live, bound=1 << 20)
    outbox.put(TOPIC, b"a", b"whole")
    outbox.put(TOPIC, b"b", b"torn")
    copy.mkdir()  # the files as a kill mid-write leaves them: the last record's commit cut short
    for name in ("slot-0.db", "slot-0.db-wal"):
        shutil.copy(live / name, copy / name)
    wal = copy / "slot-0.db-wal"
    wal.write_bytes(wal.read_bytes()[:-100])
    recovered = Outbox(copy, bound=1 << 20)
    assert values(recovered) == [b"whole"] and recovered.records == 1
    assert recovered.put(TOPIC, b"c", b"after")
    recovered.close()
    assert values(Outbox(copy, bound=1 << 20)) == [b"whole", b"after"]


def test_a_record_the_broker_will_never_take_is_dropped_not_retried_forever(tmp_path):
    outbox = Outbox(tmp_path, bound=1 << 20)
    outbox.put(TOPIC, None, b"x" * 2000)
    producer = Producer({"bootstrap.servers": "127.0.0.1:9", "message.max.bytes": 1000})  # nobody there
    before = dropped()
    assert asyncio.run(Republisher(outbox, producer).publish(outbox.oldest(1 << 20))) == 0
    assert outbox.records == 0 and dropped() == before + 1


def test_each_gateway_on_a_data_dir_keeps_its_own_outbox(tmp_path):
    first, second = Outbox(tmp_path, 1000), Outbox(tmp_path, 1000)
    assert first.path != second.path
    first.close()
    assert Outbox(tmp_path, 1000).path == first.path  # a restarted gateway finds what it left


class Relay:
    """The broker's port as the gateway sees it: a bound socket that does not listen (a
    connection is refused: a real broker cannot be made to vanish on demand) until `open()`,
    then a relay to the stack's broker."""

    def __init__(self, target: int):
        self.target = target
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.server.close()

    def open(self) -> None:
        self.server.listen()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=(source, sink), daemon=True).start()


def pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        sink.close()


def trajectories(settings, cid: str) -> int:
    return sql(settings, f"SELECT count() AS n FROM trajectories WHERE completion_id = '{cid}'")[0]["n"]


def test_a_completion_served_while_the_broker_is_away_is_recorded_once_it_is_back(settings, dev_keys, monkeypatch):
    monkeypatch.setattr(serving.recorder, "DELIVERY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(serving.republisher, "RETRY_S", 0.2)
    relay = Relay(settings.broker.port)
    away = settings.model_copy(update={"broker": EmbeddedBroker(port=relay.port)})
    failures = REGISTRY.get_sample_value("liverl_gateway_record_failures_total")
    try:
        with TestClient(create_app(away)) as gateway:
            left = held()  # what earlier gateways on this data directory left, if any
            served = gateway.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 2},
                                  headers={"Authorization": f"Bearer {dev_keys['tenant_key']}"})
            assert served.status_code == 200, served.text
            cid = served.json()["completion_id"]
            wait_for(lambda: held() >= left + 2, timeout=15)  # the trajectory and its request's row
            time.sleep(1)  # longer than a delivery timeout: nothing reached the broker
            assert trajectories(settings, cid) == 0
            relay.open()
            assert wait_for(lambda: trajectories(settings, cid), timeout=60) == 1
            wait_for(lambda: held() == 0, timeout=15)
    finally:
        relay.close()
    assert REGISTRY.get_sample_value("liverl_gateway_record_failures_total") == failures  # none lost


KILLED_WITH_A_RECORD = """
import os, sys
from pathlib import Path
from serving.outbox import WAL_LIMIT_BYTES, Outbox
Outbox(Path(sys.argv[1]), 1 << 20).put("liverl.requests", b"k", sys.stdin.buffer.read())
os.kill(os.getpid(), 9)
"""


def test_records_a_killed_gateway_left_are_republished_when_the_next_starts(settings, tmp_path):
    from liverl.contracts import RequestRecord, Topics, new_id
    from liverl.kafka import encode

    assert Topics.REQUESTS == "liverl.requests"
    row = RequestRecord(event_id=new_id("req"), tenant="default", endpoint="completions", status=503, latency_ms=1.0)
    killed = subprocess.run([sys.executable, "-c", KILLED_WITH_A_RECORD, str(tmp_path / "outbox" / "gateway")],
                            input=encode(row), cwd=REPO_ROOT, check=False)
    assert killed.returncode == -9

    async def start_and_drain() -> None:
        recorder = Recorder(settings.model_copy(update={"data_dir": tmp_path}))
        await recorder.start()
        try:
            assert recorder.outbox.records == 1
            for _ in range(300):
                if not recorder.outbox.records:
                    break
                await asyncio.sleep(0.1)
            assert recorder.outbox.records == 0
        finally:
            await recorder.stop()

    asyncio.run(start_and_drain())
    query = f"SELECT count() AS n FROM requests WHERE event_id = '{row.event_id}'"
    assert wait_for(lambda: sql(settings, query)[0]["n"]) == 1
