"""The fault suite: under steady load, kill -9 each process of the stack in turn at random
moments, let the supervisor start it again, and check from outside that every acknowledged
event is in ClickHouse exactly once and no sample was learned twice.

    .venv/bin/python benchmarks/bench_faults.py [--kills 3] [--rate 400] [--out results.json]

It starts its own stack (every port moved by --port-offset, data in --data-dir) with the
learner on. The load is bounded: one client sending a batch of `--rate / 5` items five
times a second to the ingest API, half of them feedback events and half trajectories
with their feedback (so the learner trains on them). The suite's short version runs in
CI: tests/test_broker_durability.py, tests/test_supervisor.py and the learner killed at
its durable steps (tests/test_learning_plane.py). Results: docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import item, sql  # noqa: E402

from app.stack import down, up  # noqa: E402
from liverl.keys import admin_headers  # noqa: E402
from liverl.manifest import read_manifest  # noqa: E402
from liverl.process import alive, answers  # noqa: E402
from liverl.settings import (  # noqa: E402
    EmbeddedBroker,
    FeedbackConfig,
    LearnerConfig,
    PortsConfig,
    PromotionConfig,
    ServingConfig,
    Settings,
)
from policies.registry import Registry  # noqa: E402

console = Console()
FAULTS = ("api", "gateway", "feedback", "sink", "learner", "controller", "broker", "broker-store")


def fault_settings(data_dir: Path, offset: int) -> Settings:
    return Settings(
        data_dir=data_dir,
        ports=PortsConfig(api=28080 + offset, gateway=28000 + offset, sink=28090 + offset, feedback=28070 + offset,
                          learner=28060 + offset, controller=28050 + offset, capacity=28040 + offset,
                          rollouts=28030 + offset, evaluator=28020 + offset, supervisor=28010 + offset,
                          replica_base=28100 + offset),
        broker=EmbeddedBroker(port=29092 + offset),
        serving=ServingConfig(replicas=1),
        feedback=FeedbackConfig(reward_window_s=3.0, sweep_interval_s=1.0),
        learner=LearnerConfig(batch_samples=32, min_samples=1, max_version_lag=1000, gate_min_ess=1.0,
                              gate_margin=1.0),
        promotion=PromotionConfig(auto_promote=True, canary_guard=False),
    )


class Load:
    """One client at a bounded rate; remembers what the API acknowledged, and when."""

    def __init__(self, settings: Settings, rate: int):
        keys = json.loads(settings.dev_keys_file.read_text())
        self.client = httpx.Client(base_url=settings.url(settings.ports.api), timeout=30,
                                   headers={"Authorization": f"Bearer {keys['tenant_key']}"})
        self.settings, self.per_batch = settings, max(rate // 5, 4)
        self.acknowledged: list[tuple[float, str]] = []
        self.samples: list[str] = []  # completion ids of the trajectories acknowledged with their feedback
        self.refused = 0
        self.version = "v0"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def batch(self) -> list[dict]:
        stable = Registry(self.settings.policies_dir).stable()  # None for a moment while it moves
        self.version = stable.version if stable else self.version
        version = self.version
        items = []
        for i in range(self.per_batch // 2):
            event = {"kind": "accept", "completion_id": f"c-{uuid.uuid4().hex}"}
            items.append(item(f"fault-fb-{uuid.uuid4().hex}", event))
            if i % 2:
                cid = f"cmpl-fault-{uuid.uuid4().hex}"
                items.append(item(f"fault-t-{cid}", {
                    "completion_id": cid, "policy_version": version, "prompt_token_ids": [5, 6, 7],
                    "completion_token_ids": [8, 9, 10, 11], "completion_logprobs": [-2.0, -2.1, -1.9, -2.2]},
                    type="trajectory"))
                reward = {"kind": "accept" if i % 4 == 1 else "reject", "completion_id": cid}
                items.append(item(f"fault-f-{cid}", reward))
        return items

    def run(self) -> None:
        while not self.stop.wait(0.2):
            batch = self.batch()
            try:
                results = self.client.post("/v1/ingestion", json={"batch": batch}).json()["results"]
            except (httpx.HTTPError, ValueError, KeyError):
                self.refused += len(batch)
                continue
            now = time.time()
            by_id = {b["id"]: b for b in batch}
            for result in results:
                if result["status"] != 201:
                    self.refused += 1
                    continue
                self.acknowledged.append((now, result["id"]))
                if by_id[result["id"]]["type"] == "trajectory":
                    self.samples.append(by_id[result["id"]]["body"]["completion_id"])


def kill_and_recover(settings: Settings, name: str, timeout: float = 180) -> float:
    """SIGKILL `name`; seconds until the supervisor has it running and healthy again."""
    before = next(c for c in read_manifest(settings).components if c.name == name)
    killed = time.time()
    os.kill(before.pid, signal.SIGKILL)
    while time.time() - killed < timeout:
        now = next(c for c in read_manifest(settings).components if c.name == name)
        if now.pid != before.pid and alive(now.pid) and (not now.health or answers(now.health)):
            return time.time() - killed
        time.sleep(0.2)
    raise RuntimeError(f"{name} was not healthy {timeout:.0f} s after its kill; see {before.log}")


def stored_counts(settings: Settings) -> dict[str, int]:
    counts = {}
    for table in ("feedback_events", "trajectories"):
        counts.update({r["event_id"]: r["n"] for r in sql(
            settings, f"SELECT event_id, count() AS n FROM {table} WHERE event_id LIKE 'fault-%' GROUP BY event_id")})
    return counts


def check(settings: Settings, load: Load, phases: list[dict], settle_s: float) -> None:
    acknowledged = {i for _, i in load.acknowledged}
    deadline = time.time() + settle_s
    while (counts := stored_counts(settings)).keys() < acknowledged and time.time() < deadline:
        time.sleep(2)
    registry = Registry(settings.policies_dir)
    ids = sorted({f"dev:{cid}" for cid in load.samples})
    for _ in range(int(settle_s / 2)):
        httpx.post(settings.url(settings.ports.learner) + "/flush", headers=admin_headers(settings), timeout=30)
        if registry.trained(ids) == set(ids):
            break
        time.sleep(2)
    learned = registry.times_learned(ids)
    for phase in phases:
        mine = {i for t, i in load.acknowledged if phase["from"] <= t < phase["to"]}
        samples = {f"dev:{i.removeprefix('fault-t-')}" for i in mine if i.startswith("fault-t-")}
        phase.update(acknowledged=len(mine), found=sum(1 for i in mine if i in counts),
                     duplicates=sum(1 for i in mine if counts.get(i, 0) > 1),
                     learned_twice=sum(1 for s in samples if learned.get(s, 0) > 1),
                     not_learned=sum(1 for s in samples if not learned.get(s)))


def report(phases: list[dict]) -> Table:
    table = Table(title="fault suite: kill -9 under load, restarted by the supervisor")
    for column in ("fault", "times", "acknowledged", "found", "duplicates", "learned twice", "not learned",
                   "recovery p50 s", "recovery max s"):
        table.add_column(column, justify="right")
    for p in phases:
        table.add_row(p["fault"], str(len(p["recovery_s"])), str(p["acknowledged"]), str(p["found"]),
                      str(p["duplicates"]), str(p["learned_twice"]), str(p["not_learned"]),
                      f"{statistics.median(p['recovery_s']):.1f}", f"{max(p['recovery_s']):.1f}")
    return table


def main(data_dir: Path = typer.Option(Path("/tmp/liverl-bench-faults"), help="The stack's data directory."),
         port_offset: int = typer.Option(7000, help="Every port moved by this (as LIVERL_TEST_PORT_OFFSET)."),
         kills: int = typer.Option(3, min=1, help="Kills of each process."),
         rate: int = typer.Option(400, min=20, help="Items a second the load sends."),
         faults: list[str] = typer.Option(list(FAULTS), help="The processes to kill, in turn."),
         settle_s: float = typer.Option(300, help="How long the end may wait for every event and sample."),
         seed: int = typer.Option(0, help="Seed of the random moments."),
         out: Path | None = typer.Option(None, help="Write the table as JSON here.")) -> None:
    rng = random.Random(seed)
    settings = fault_settings(data_dir, port_offset)
    up(settings, say=console.print, progress=False)
    load = Load(settings, rate)
    load.thread.start()
    phases = []
    try:
        for name in faults:
            phase: dict = {"fault": name, "from": time.time(), "recovery_s": []}
            for _ in range(kills):
                time.sleep(rng.uniform(2, 8))
                phase["recovery_s"].append(kill_and_recover(settings, name))
                console.print(f"{name}: back in {phase['recovery_s'][-1]:.1f} s")
            time.sleep(3)
            phase["to"] = time.time()
            phases.append(phase)
        load.stop.set()
        load.thread.join(timeout=60)
        # What was acknowledged, kept beside the stack: the check can be made again by hand.
        (data_dir / "fault-load.json").write_text(json.dumps({"acknowledged": load.acknowledged,
                                                              "samples": load.samples, "phases": phases}))
        check(settings, load, phases, settle_s)
    finally:
        load.stop.set()
        down(settings, say=console.print, force=True)
    console.print(report(phases))
    console.print(f"refused (503 or no answer, the client's to send again): {load.refused}")
    if out:
        out.write_text(json.dumps({"phases": phases, "refused": load.refused, "rate": rate, "kills": kills}, indent=2))


if __name__ == "__main__":
    typer.run(main)
