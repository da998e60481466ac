"""The soak (issue 43): the whole stack at a share of its measured sustained capacity for
minutes, watching every process's resident memory, the stream's and the sink's consumer
lag and every error, then checking that every acknowledged event is stored once.

    .venv/bin/python benchmarks/bench_soak.py --minutes 10 --share 0.8 --out benchmarks/results/soak-NAME

It starts its own stack (ports moved by --port-offset, data in --data-dir, the broker in
--broker mode), learner and one replica on. Capacity is measured first, in the same run:
the soak's load offered above it (--probe-rate) for --probe-s, and the rate at which the
stream and the sink commit what ingest wrote over the probe's last two thirds; the slowest
stage is the capacity, what the stack keeps up with for good, not what the API accepts in a
burst. Then the soak: every 0.1 s a batch at
`share x capacity` events/s, completions' trajectories each with its user's feedback
(joined, rewarded, handed to the learner, which keeps up with a small share of them and
lags by design), and one completion a second through the gateway. The stream keeps each
completion for `--window-s` (feedback.reward_window_s): its memory grows for one window,
then must stay flat. Every 10 s: each
process's resident memory (children included), the consumer lags, the answers that were
not 201, the supervisor's restarts. Results: a JSON, a table, a plot (memory and lag
over time); docs/reliability.md has the runs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

import httpx
import psutil
import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_ingest import settle  # noqa: E402
from helpers import item  # noqa: E402

from app.stack import DRAINED_GROUPS, down, status, up  # noqa: E402
from liverl.contracts import Topics  # noqa: E402
from liverl.kafka import group_lag, group_positions  # noqa: E402
from liverl.keys import admin_headers  # noqa: E402
from liverl.manifest import read_manifest  # noqa: E402
from liverl.pool import read_pool  # noqa: E402
from liverl.settings import EmbeddedBroker, FeedbackConfig, PortsConfig, ServingConfig, Settings  # noqa: E402

console = Console()
READING_EVERY_S = 10.0


def soak_settings(data_dir: Path, offset: int, broker: Literal["disk", "memory"], window_s: float,
                  retention: dict[str, float] | None = None) -> Settings:
    return Settings(
        data_dir=data_dir,
        ports=PortsConfig().shifted(10_000 + offset),
        broker=EmbeddedBroker(port=29092 + offset, storage=broker, **(retention or {})),
        serving=ServingConfig(replicas=1),
        feedback=FeedbackConfig(reward_window_s=window_s),
    )


class Load:
    """Paced ingest at `rate` events/s and one gateway completion a second; counts what was
    acknowledged and what was not."""

    def __init__(self, settings: Settings, rate: float, run: str):
        key = json.loads(settings.dev_keys_file.read_text())["tenant_key"]
        auth = {"Authorization": f"Bearer {key}"}
        self.api = httpx.Client(base_url=settings.url(settings.ports.api), timeout=30, headers=auth)
        self.gateway = httpx.Client(base_url=settings.url(settings.ports.gateway), timeout=60, headers=auth)
        self.rate, self.run = rate, run
        self.acknowledged = 0
        self.refused: dict[str, int] = {}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.ingest, daemon=True),
                        threading.Thread(target=self.serve, daemon=True)]

    def batch(self, size: int) -> list[dict]:
        """`size` events: completions' trajectories, each followed by its user's feedback."""
        items = []
        for i in range(0, size, 2):
            cid = f"cmpl-{self.run}-{uuid.uuid4().hex}"
            items.append(item(f"{self.run}-t-{cid}", {
                "completion_id": cid, "policy_version": "v0", "prompt_token_ids": [5, 6, 7],
                "completion_token_ids": [8, 9, 10, 11], "completion_logprobs": [-2.0, -2.1, -1.9, -2.2]},
                type="trajectory"))
            items.append(item(f"{self.run}-f-{cid}", {"kind": "accept" if i % 4 else "reject", "completion_id": cid}))
        return items

    def count(self, status: str) -> None:
        self.refused[status] = self.refused.get(status, 0) + 1

    def send(self, batch: list[dict]) -> None:
        for result in self.api.post("/v1/ingestion", json={"batch": batch}).json()["results"]:
            if result["status"] == 201:
                self.acknowledged += 1
            else:
                self.count(f"ingest {result['status']}")

    def ingest(self) -> None:
        tick, owed = 0.1, 0.0
        next_send = time.perf_counter()
        while not self.stop.is_set():
            owed += self.rate * tick
            size, owed = int(owed), owed - int(owed)
            if size:
                try:
                    self.send(self.batch(size))
                except (httpx.HTTPError, ValueError, KeyError) as error:
                    self.count(f"ingest {type(error).__name__}")
            next_send += tick
            self.stop.wait(max(0.0, next_send - time.perf_counter()))

    def serve(self) -> None:
        while not self.stop.wait(1.0):
            try:
                answer = self.gateway.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 16})
                if answer.status_code != 200:
                    self.count(f"gateway {answer.status_code}")
                    continue
                cid = answer.json()["completion_id"]
                self.send([item(f"{self.run}-g-{cid}", {"kind": "accept", "completion_id": cid})])
            except (httpx.HTTPError, ValueError, KeyError) as error:
                self.count(f"gateway {type(error).__name__}")


def processes(settings: Settings) -> dict[str, list[psutil.Process]]:
    """Every process of the stack by component (a component's children counted with it)."""
    roots = {c.name: c.pid for c in read_manifest(settings).components}  # type: ignore[union-attr]
    roots.update({r.name: r.pid for r in read_pool(settings).replicas if r.pid})
    found = {}
    for name, pid in roots.items():
        try:
            root = psutil.Process(pid)
            found[name] = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            found[name] = []
    return found


def rss_mib(settings: Settings) -> dict[str, float]:
    def one(p: psutil.Process) -> int:
        try:
            return p.memory_info().rss
        except psutil.NoSuchProcess:
            return 0
    return {name: sum(map(one, ps)) / 2**20 for name, ps in processes(settings).items()}


def cpu_s(settings: Settings) -> dict[str, float]:
    """CPU seconds each component has used (its live processes), and this benchmark's own
    (the load generator shares the two cores with the stack)."""
    def one(p: psutil.Process) -> float:
        try:
            times = p.cpu_times()
            return times.user + times.system
        except psutil.NoSuchProcess:
            return 0.0
    used = {name: sum(map(one, ps)) for name, ps in processes(settings).items()}
    return {**used, "load generator": one(psutil.Process())}


def cores(earlier: dict, later: dict) -> dict[str, float]:
    """Each component's share of the machine between two readings, in cores."""
    span = later["t"] - earlier["t"]
    return {name: max(0.0, used - earlier["cpu_s"].get(name, used)) / span for name, used in later["cpu_s"].items()}


def lags(settings: Settings) -> dict[str, int]:
    groups = {**{g: topics for g, (_, topics) in DRAINED_GROUPS.items()}, "liverl-learner": (Topics.SAMPLES,)}
    found = {}
    for group, topics in groups.items():
        try:
            found[group] = asyncio.run(asyncio.wait_for(group_lag(settings, group, topics), 20))
        except Exception:
            found[group] = -1  # the broker did not answer in time: shown, not hidden
    return found


def stored(settings: Settings, run: str) -> tuple[int, int]:
    """Rows of this run's events in ClickHouse (feedback and trajectories), and distinct
    event ids among them."""
    rows, distinct = 0, 0
    for table in ("feedback_events", "trajectories"):
        answer = httpx.post(settings.url(settings.ports.sink) + "/sql", headers=admin_headers(settings), timeout=120,
                            json={"sql": f"SELECT count() AS n, uniqExact(event_id) AS d FROM {table} "
                                         f"WHERE startsWith(event_id, '{run}-')", "format": "json"}).json()["data"][0]
        rows, distinct = rows + int(answer["n"]), distinct + int(answer["d"])
    return rows, distinct


def restarts(settings: Settings) -> int:
    return sum(int(c.get("restarts") or 0) for c in status(settings)["components"])


INGESTED = (Topics.FEEDBACK, Topics.TRAJECTORIES)  # what ingest writes: what capacity is counted in


def committed(settings: Settings, group: str) -> int:
    """Messages of the ingested topics consumer group `group` has committed (processed for good)."""
    positions = asyncio.run(asyncio.wait_for(group_positions(settings, group, INGESTED), 20))
    return sum(at for _, at in positions.values())


def caught_up(settings: Settings, timeout_s: float = 1800.0) -> float:
    """Seconds until the stream and the sink have processed everything (the learner lags by
    design: `liverl down` waits for it, the soak does not)."""
    started = time.perf_counter()
    with console.status("the stream and the sink catching up") as shown:
        while time.perf_counter() - started < timeout_s:
            behind = {group: lag for group, lag in lags(settings).items() if group in DRAINED_GROUPS}
            if not any(behind.values()):
                return time.perf_counter() - started
            shown.update(f"catching up: {behind}")
            time.sleep(5)
    raise TimeoutError(f"the stream and the sink not caught up in {timeout_s:.0f} s")


def capacity(settings: Settings, probe_s: float, probe_rate: float) -> dict:
    """Events a second the stack keeps up with for good: load paced above it for `probe_s`
    (the learner training and the replica serving, as in the soak), and the rate at which
    the stream and the sink commit the ingested topics over its last two thirds (the first
    fills the pipes). The slowest of ingest, stream and sink is the capacity. A short burst
    and its catch-up overstated it 2.5 times: the learner had not started training yet."""
    load = Load(settings, probe_rate, f"probe{uuid.uuid4().hex[:6]}")
    for thread in load.threads:
        thread.start()
    with console.status(f"probing capacity: {probe_rate:,.0f} events/s offered for {probe_s:.0f} s"):
        time.sleep(probe_s / 3)
        start = time.perf_counter(), load.acknowledged, {g: committed(settings, g) for g in DRAINED_GROUPS}
        time.sleep(probe_s * 2 / 3)
        end = time.perf_counter(), load.acknowledged, {g: committed(settings, g) for g in DRAINED_GROUPS}
    load.stop.set()
    for thread in load.threads:
        thread.join(60)
    span_s = end[0] - start[0]
    rates = {"ingest": (end[1] - start[1]) / span_s,
             **{group: (end[2][group] - start[2][group]) / span_s for group in DRAINED_GROUPS}}
    if min(rates.values()) <= 0:
        raise RuntimeError(f"a stage processed nothing during the probe: {rates}")
    caught_up(settings)
    return {"offered_per_s": probe_rate, "probe_s": probe_s, "rates_per_s": rates, "refused": load.refused,
            "events_per_s": min(rates.values())}


def table(readings: list[dict]) -> Table:
    shown = Table(title="soak")
    for column in ("t (s)", "acknowledged", "refused", "lag stream / sink / learner", "RSS MiB (largest 4)",
                   "cores (busiest 5)"):
        shown.add_column(column)
    for earlier, r in list(zip([None, *readings], readings, strict=False))[-12:]:  # one more earlier
        largest = sorted(r["rss_mib"].items(), key=lambda kv: -kv[1])[:4]
        busiest = sorted(cores(earlier, r).items(), key=lambda kv: -kv[1])[:5] if earlier else []
        shown.add_row(f"{r['t']:.0f}", f"{r['acknowledged']:,}", str(sum(r["refused"].values())),
                      " / ".join(str(r["lags"][g]) for g in ("liverl-feedback", "liverl-sink", "liverl-learner")),
                      ", ".join(f"{n} {v:.0f}" for n, v in largest), ", ".join(f"{n} {v:.2f}" for n, v in busiest))
    return shown


def plot(readings: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, lag, cpu) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    t = [r["t"] / 60 for r in readings]
    for name in readings[0]["rss_mib"]:
        memory.plot(t, [r["rss_mib"].get(name, 0) for r in readings], label=name)
    memory.set_ylabel("resident MiB")
    memory.legend(fontsize=7, ncol=3)
    for group in readings[0]["lags"]:
        lag.plot(t, [r["lags"][group] for r in readings], label=group)
    lag.set_ylabel("consumer lag (messages)")
    lag.legend(fontsize=7)
    shares = [cores(earlier, later) for earlier, later in itertools.pairwise(readings)]
    for name in readings[0]["cpu_s"]:
        cpu.plot(t[1:], [share.get(name, 0) for share in shares], label=name)
    cpu.set_ylabel("CPU (cores)")
    cpu.set_xlabel("minutes into the soak")
    cpu.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)


def soak(settings: Settings, rate: float, minutes: float, run: str) -> tuple[Load, list[dict]]:
    load = Load(settings, rate, run)
    readings: list[dict] = []
    started = time.perf_counter()
    for thread in load.threads:
        thread.start()
    with Live(table(readings), console=console, refresh_per_second=1) as live:
        while time.perf_counter() - started < minutes * 60:
            time.sleep(READING_EVERY_S)
            readings.append({"t": time.perf_counter() - started, "acknowledged": load.acknowledged,
                             "refused": dict(load.refused), "lags": lags(settings), "rss_mib": rss_mib(settings),
                             "cpu_s": cpu_s(settings), "restarts": restarts(settings)})
            live.update(table(readings))
    load.stop.set()
    for thread in load.threads:
        thread.join(60)
    return load, readings


def summary(cap: dict, rate: float, load: Load, readings: list[dict], found: tuple[int, int], drain_s: float) -> dict:
    # Memory after the first minute's warm-up (a shorter soak: its first reading).
    warm = next((r for r in readings if r["t"] >= 60), readings[0])
    last = readings[-1]
    growth = {name: (last["rss_mib"].get(name, 0) - warm["rss_mib"][name]) for name in warm["rss_mib"]}
    return {"capacity": cap, "rate": rate, "acknowledged": load.acknowledged, "refused": load.refused,
            "stored": found[0], "stored_distinct": found[1], "drain_after_s": drain_s,
            "max_lag": {g: max(r["lags"][g] for r in readings) for g in readings[0]["lags"]},
            "median_lag": {g: statistics.median(r["lags"][g] for r in readings) for g in readings[0]["lags"]},
            "rss_mib_at_1_min": warm["rss_mib"], "rss_mib_at_end": last["rss_mib"], "rss_growth_mib": growth,
            "restarts": last["restarts"] - readings[0]["restarts"],
            "cores_first_half": cores(readings[0], readings[len(readings) // 2]),
            "cores_second_half": cores(readings[len(readings) // 2], last)}


def main(minutes: float = typer.Option(10.0, help="How long the soak lasts."),
         share: float = typer.Option(0.8, help="The soak's rate as a share of the measured capacity."),
         probe_s: float = typer.Option(120.0, help="Seconds of the capacity probe."),
         probe_rate: float = typer.Option(4000.0, help="Events a second the probe offers: above the capacity."),
         rate: float | None = typer.Option(None, help="Events a second, instead of measuring the capacity."),
         broker: Literal["disk", "memory"] = typer.Option("disk", help="The embedded broker's storage."),
         window_s: float = typer.Option(60.0, help="feedback.reward_window_s: the stream keeps each completion "
                                        "this long, so its memory is flat only after one window (default 1 h)."),
         retention_batches: int | None = typer.Option(None, help="broker.retention_batches (default: setting's)."),
         retention_check_s: float | None = typer.Option(None, help="broker.retention_check_s (default: setting's)."),
         data_dir: Path = typer.Option(Path("/tmp/liverl-bench-soak")), port_offset: int = 6000,
         keep_data: bool = typer.Option(False, help="Start on what data_dir holds; by default it is emptied "
                                        "first: an earlier run's backlog (the learner's group holds the samples "
                                        "log) would load this one."),
         out: Path = typer.Option(Path("bench-soak"))) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if not keep_data:
        shutil.rmtree(data_dir, ignore_errors=True)
    retention = {k: v for k, v in (("retention_batches", retention_batches), ("retention_check_s", retention_check_s))
                 if v is not None}
    settings = soak_settings(data_dir, port_offset, broker, window_s, retention)
    up(settings, say=console.print)
    run = f"soak{uuid.uuid4().hex[:6]}"
    try:
        console.print(f"the stack settled in {settle(settings, 0.25):.0f} s")
        cap = capacity(settings, probe_s, probe_rate) if rate is None else {"events_per_s": rate / share, "given": True}
        rate = share * cap["events_per_s"]
        stages = ", ".join(f"{stage} {r:,.0f}/s" for stage, r in cap.get("rates_per_s", {}).items())
        console.print(f"capacity {cap['events_per_s']:,.0f} events/s ({stages}): soaking at {rate:,.0f} "
                      f"for {minutes} min")
        load, readings = soak(settings, rate, minutes, run)
        drain_s = caught_up(settings)
        result = summary(cap, rate, load, readings, stored(settings, run), drain_s)
    finally:
        down(settings, say=console.print, force=True)
    (out / "soak.json").write_text(json.dumps({"summary": result, "readings": readings}, indent=1))
    plot(readings, out)
    console.print_json(json.dumps(result))


if __name__ == "__main__":
    typer.run(main)
