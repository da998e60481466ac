"""The fault suite: under steady load, kill -9 each process of the stack in turn at random
moments, let liverl bring it back, and check from outside that every acknowledged event is
in ClickHouse exactly once and every rewarded sample was learned exactly once or dropped.

    .venv/bin/python benchmarks/bench_faults.py [--kills 2] [--rate 300] [--out results.json]

It starts its own stack (every port moved by --port-offset, data in --data-dir) with the
learner on and one vLLM replica. The load is bounded, from one client on loopback: `--rate`
feedback events a second, and rewarded samples (a trajectory and its feedback) at
`--samples-share` of the learner's rate, which it measures first (`calibrate`), so the
learner keeps up and a sample not learned by the end is lost, not still waiting.

Faults, in turn: each of api, gateway, feedback, sink, learner, controller, broker and
broker-store killed `--kills` times at random moments (the supervisor restarts it); the
learner dying at each of its durable steps (LIVERL_FAULT, once each); a replica killed
mid-swap (the promotion controller must bring it back serving one whole version, checked
against that version's probe); the controller killed mid-canary (the canary must finish or
abort, and every replica then serve stable). Recovery is kill to healthy and caught up (the
component's consumer groups back to their lag before the kill, give or take a second of
load). At the end it waits for the learner's lag on the samples topic to reach 0, then
checks by sample id against the registry's per-version record (a list that keeps repeats)
and its record of dropped samples. The short version runs in CI:
tests/test_broker_durability.py, tests/test_supervisor.py, tests/test_learning_plane.py.
Results: docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import item, sql  # noqa: E402

from app.stack import down, restart, up  # noqa: E402
from liverl.contracts import Topics  # noqa: E402
from liverl.kafka import group_lag, group_positions  # noqa: E402
from liverl.keys import admin_headers  # noqa: E402
from liverl.manifest import read_manifest  # noqa: E402
from liverl.pool import read_pool  # noqa: E402
from liverl.process import alive, answers  # noqa: E402
from liverl.settings import (  # noqa: E402
    EmbeddedBroker,
    FeedbackConfig,
    LearnerConfig,
    PortsConfig,
    PromotionConfig,
    ServingConfig,
    Settings,
    SupervisorConfig,
)
from policies.registry import Registry  # noqa: E402
from serving.swap import verify  # noqa: E402

console = Console(width=200)
FAULTS = ("api", "gateway", "feedback", "sink", "learner", "controller", "broker", "broker-store")
# The learner's durable steps (crash_point names): after training, after saving its
# optimizer state, inside publishing (a directory not yet a version), after publishing,
# after committing the offsets, inside shipping the delta.
LEARNER_STEPS = ("learner.after_train", "learner.after_save_state", "registry.publish.after_rename",
                 "learner.after_publish", "learner.after_commit", "sync.ship.before_retention")
# The consumer groups a component's death holds back: caught up once they are.
GROUPS = {"liverl-feedback": (Topics.TRAJECTORIES, Topics.FEEDBACK), "liverl-sink": Topics.ALL,
          "liverl-learner": (Topics.SAMPLES,)}
HOLDS = {"feedback": ("liverl-feedback",), "sink": ("liverl-sink",), "learner": ("liverl-learner",),
         "broker": tuple(GROUPS), "broker-store": tuple(GROUPS)}


def fault_settings(data_dir: Path, offset: int) -> Settings:
    return Settings(
        data_dir=data_dir,
        ports=PortsConfig().shifted(10_000 + offset),
        broker=EmbeddedBroker(port=29092 + offset),
        serving=ServingConfig(replicas=1),
        feedback=FeedbackConfig(reward_window_s=3.0, sweep_interval_s=1.0),
        learner=LearnerConfig(batch_samples=32, min_samples=1, max_version_lag=1000, gate_min_ess=1.0,
                              gate_margin=1.0),
        promotion=PromotionConfig(auto_promote=True, canary_guard=False),
        # The learner dies 8+ times in minutes here (default 5 in 10 minutes: left down).
        supervisor=SupervisorConfig(max_restarts=20),
    )


def sample_items(version: str, accept: bool) -> tuple[str, list[dict]]:
    """A trajectory and its feedback: one rewarded sample; its completion id."""
    cid = f"cmpl-fault-{uuid.uuid4().hex}"
    return cid, [item(f"fault-t-{cid}", {
        "completion_id": cid, "policy_version": version, "prompt_token_ids": [5, 6, 7],
        "completion_token_ids": [8, 9, 10, 11], "completion_logprobs": [-2.0, -2.1, -1.9, -2.2]},
        type="trajectory"),
        item(f"fault-f-{cid}", {"kind": "accept" if accept else "reject", "completion_id": cid})]


class Load:
    """One client at a bounded rate; remembers what the API acknowledged, and when."""

    def __init__(self, settings: Settings, rate: float, samples_per_s: float):
        keys = json.loads(settings.dev_keys_file.read_text())
        self.client = httpx.Client(base_url=settings.url(settings.ports.api), timeout=30,
                                   headers={"Authorization": f"Bearer {keys['tenant_key']}"})
        self.settings, self.rate, self.samples_per_s = settings, rate, samples_per_s
        self.registry = Registry(settings.policies_dir)
        self.acknowledged: list[tuple[float, str]] = []
        self.samples: list[str] = []  # completion ids of the trajectories acknowledged with their feedback
        self.refused = 0
        self.owed = 0.0  # samples due but not yet sent (the rate is fractional per tick)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def batch(self) -> list[dict]:
        stable = self.registry.stable()
        assert stable is not None, "stable is never missing, even mid-promotion (tests/test_registry_promotion.py)"
        items = [item(f"fault-fb-{uuid.uuid4().hex}", {"kind": "accept", "completion_id": f"c-{uuid.uuid4().hex}"})
                 for _ in range(round(self.rate / 5))]
        self.owed += self.samples_per_s / 5
        while self.owed >= 1:
            self.owed -= 1
            items += sample_items(stable.version, accept=random.random() < 0.5)[1]
        return items

    def send(self, batch: list[dict]) -> None:
        try:
            results = self.client.post("/v1/ingestion", json={"batch": batch}).json()["results"]
        except (httpx.HTTPError, ValueError, KeyError):
            self.refused += len(batch)
            return
        now = time.time()
        by_id = {b["id"]: b for b in batch}
        for result in results:
            if result["status"] != 201:
                self.refused += 1
                continue
            self.acknowledged.append((now, result["id"]))
            if by_id[result["id"]]["type"] == "trajectory":
                self.samples.append(by_id[result["id"]]["body"]["completion_id"])

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.send(self.batch())


def calibrate(settings: Settings, load: Load, n: int) -> float:
    """The learner's rate in samples a second: `n` samples sent at once, timed from its first
    version written on them to its last (each version's start-up and the send excluded)."""
    registry = Registry(settings.policies_dir)
    before = registry.latest().seq  # type: ignore[union-attr]
    stable = registry.stable()
    assert stable is not None, "the starter is stable from the start"
    for _ in range(n // 100):
        load.send([i for _ in range(100) for i in sample_items(stable.version, random.random() < 0.5)[1]])
    ids = sorted(f"dev:{c}" for c in load.samples)
    deadline = time.time() + 600
    while len(registry.times_learned(ids).keys() | registry.dropped(ids).keys()) < len(ids) and time.time() < deadline:
        flush(settings)
        time.sleep(2)
    versions = [v for v in registry.versions() if v.seq > before and v.window]
    if len(versions) < 2:
        raise RuntimeError(f"the learner wrote {len(versions)} versions on {n} samples; cannot time it")
    learned = sum(v.window.samples for v in versions[1:] if v.window)
    return learned / (versions[-1].created_at - versions[0].created_at)


def flush(settings: Settings) -> None:
    try:
        httpx.post(settings.url(settings.ports.learner) + "/flush", headers=admin_headers(settings), timeout=10)
    except httpx.HTTPError:
        pass  # restarting: the next look asks again


def lags(settings: Settings, groups: tuple[str, ...]) -> dict[str, int]:
    """Each group's messages not yet committed; -1 while the broker does not answer."""
    found = {}
    for group in groups:
        try:
            found[group] = asyncio.run(asyncio.wait_for(group_lag(settings, group, GROUPS[group]), 20))
        except Exception:
            found[group] = -1
    return found


def positions(settings: Settings, group: str) -> dict[str, tuple[int, int]]:
    return asyncio.run(asyncio.wait_for(group_positions(settings, group, GROUPS[group]), 30))


def ends_now(settings: Settings, groups: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Where each group's partitions end now: what it must have consumed to be caught up."""
    return {group: {tp: end for tp, (end, _) in positions(settings, group).items()} for group in groups}


def caught_up(settings: Settings, ends: dict[str, dict[str, int]]) -> bool:
    """Every group has committed past the ends it had to reach (False while the broker is away)."""
    try:
        for group, must in ends.items():
            now = positions(settings, group)
            if any(now.get(tp, (0, 0))[1] < end for tp, end in must.items()):
                return False
    except Exception:
        return False
    return True


def component(settings: Settings, name: str):
    manifest = read_manifest(settings)
    assert manifest is not None, "the stack is up"
    return next(c for c in manifest.components if c.name == name)


def wait(predicate: Callable[[], object], timeout: float, interval: float = 0.2) -> float | None:
    """Seconds until `predicate` holds, or None after `timeout`."""
    started = time.time()
    while time.time() - started < timeout:
        if predicate():
            return time.time() - started
        time.sleep(interval)
    return None


def recover(settings: Settings, name: str, died: float, pid: int, ends: dict[str, dict[str, int]],
            catch_up_s: float, timeout: float = 240) -> dict:
    """Seconds from `died` until a new `name` answers its health check, and until its
    consumer groups have committed past `ends` (what was produced when it died): caught up
    (None: not within `catch_up_s` of healthy)."""
    def healthy() -> bool:
        now = component(settings, name)
        return now.pid != pid and alive(now.pid) and (not now.health or answers(now.health))

    if wait(healthy, timeout - (time.time() - died)) is None:
        raise RuntimeError(f"{name} not healthy {timeout:.0f} s after its death; see {component(settings, name).log}")
    healthy_s = time.time() - died
    caught: dict[str, float | None] = dict.fromkeys(ends)  # each group's seconds to catch up (None: not yet)
    deadline = time.time() + catch_up_s
    while None in caught.values() and time.time() < deadline:
        for group in [g for g, seconds in caught.items() if seconds is None]:
            if caught_up(settings, {group: ends[group]}):
                caught[group] = time.time() - died
        time.sleep(0.5)
    times = [t for t in caught.values() if t is not None]
    return {"healthy_s": healthy_s, "groups": caught,
            "caught_up_s": None if len(times) < len(caught) else max(times, default=healthy_s)}


def kill(settings: Settings, name: str, catch_up_s: float) -> dict:
    """SIGKILL `name` (the supervisor starts it again); its recovery. The ends to catch up
    to are read just before the kill (the broker's own kill leaves nobody to ask after)."""
    before = component(settings, name)
    ends = ends_now(settings, HOLDS.get(name, ()))
    os.kill(before.pid, signal.SIGKILL)
    return recover(settings, name, time.time(), before.pid, ends, catch_up_s)


def learner_step(settings: Settings, step: str, catch_up_s: float) -> dict:
    """The learner restarted to die at `step` (as kill -9 there would), which it does at its
    next version; then brought back by the supervisor, without the fault."""
    pid = restart(settings, "learner", f"fault suite: die at {step}", {"LIVERL_FAULT": step})["pid"]
    if wait(lambda: not alive(pid), 300) is None:
        return {"step": step, "reached": False, "healthy_s": None, "caught_up_s": None}
    died = time.time()
    result = recover(settings, "learner", died, pid, ends_now(settings, HOLDS["learner"]), catch_up_s)
    return {"step": step, "reached": True, **result}


def serves_verified(settings: Settings, registry: Registry, replica) -> bool:
    """The replica answers, in rotation, with its version's probe logprobs: one whole version."""
    try:
        verify(replica.url, Path(registry.get(replica.policy_version).model_dir), settings.learner.probe_tolerance)
    except Exception:
        return False
    return replica.enabled


def replica_mid_swap(settings: Settings, timeout: float = 180) -> dict:
    """Kill a replica's engine (its whole session) while a swap has it out of rotation; it
    must come back serving one whole verified version."""
    registry = Registry(settings.policies_dir)
    swapping = None

    def out_of_rotation() -> bool:
        nonlocal swapping
        swapping = next((r for r in read_pool(settings).general if not r.enabled and r.pid), None)
        return swapping is not None

    if wait(out_of_rotation, timeout, 0.05) is None or swapping is None or swapping.pid is None:
        return {"found": False, "healthy_s": None, "caught_up_s": None}
    os.killpg(swapping.pid, signal.SIGKILL)
    died = time.time()

    def back() -> bool:
        replica = read_pool(settings).get(swapping.name)
        return replica.pid != swapping.pid and serves_verified(settings, registry, replica)

    seconds = wait(back, timeout, 1)
    replica = read_pool(settings).get(swapping.name)
    return {"found": True, "was": swapping.policy_version, "serves": replica.policy_version,
            "verified": seconds is not None, "healthy_s": seconds and time.time() - died,
            "caught_up_s": seconds and time.time() - died}


def controller_mid_canary(settings: Settings, timeout: float = 180) -> dict:
    """Kill the controller while a version is in canary: that version must end stable or
    taken off (never left in canary), and every replica then serve stable, verified."""
    registry = Registry(settings.policies_dir)
    canary = None

    def in_canary() -> bool:
        nonlocal canary
        canary = next(iter(registry.in_state("canary")), None)
        return canary is not None

    if wait(in_canary, timeout, 0.05) is None or canary is None:
        return {"found": False, "healthy_s": None, "caught_up_s": None}
    before = component(settings, "controller")
    os.kill(before.pid, signal.SIGKILL)
    died = time.time()
    result = recover(settings, "controller", died, before.pid, {}, 0)
    ended = wait(lambda: registry.get(canary.version).state != "canary", timeout - (time.time() - died), 0.5)

    def whole() -> bool:  # every production replica in rotation on stable or on the registry's canary, verified
        stable, pool, now = registry.stable(), read_pool(settings), registry.in_state("canary")
        serving = {stable.version} if stable else set()
        return stable is not None and pool.aliases.get("canary") in {None, *(c.version for c in now)} and all(
            r.policy_version in serving | {c.version for c in now} and serves_verified(settings, registry, r)
            for r in pool.general)

    consistent = ended is not None and wait(whole, timeout - (time.time() - died), 0.5) is not None
    return {"found": True, "canary": canary.version, "ended_as": registry.get(canary.version).state,
            "consistent": consistent, "healthy_s": result["healthy_s"],
            "caught_up_s": time.time() - died if consistent else None}


def stored_counts(settings: Settings) -> dict[str, int]:
    """How many times each of the suite's events is stored, read in slices by the ids' last
    hex digits (uuid4: even slices): the analyst SQL answers at most 100,000 rows a query."""
    counts = {}
    for table in ("feedback_events", "trajectories"):
        ours = f"FROM {table} WHERE event_id LIKE 'fault-%'"
        digits = 1 if sql(settings, f"SELECT count() AS n {ours}")[0]["n"] < 1_000_000 else 2
        for k in range(16 ** digits):
            suffix = f"{k:0{digits}x}"
            counts.update({r["event_id"]: r["n"] for r in sql(
                settings, f"SELECT event_id, count() AS n {ours} AND event_id LIKE '%{suffix}' GROUP BY event_id")})
    return counts


def settle(settings: Settings, load: Load, timeout: float) -> dict:
    """Wait (at most `timeout`) until every acknowledged event is stored and every sample is
    learned or dropped; or until nothing moves: the stream's and the learner's lags 0 and no
    sample accounted for in 60 s (what is left then is lost, not waiting)."""
    from rich.progress import Progress

    registry, acknowledged = Registry(settings.policies_dir), {i for _, i in load.acknowledged}
    ids = sorted({f"dev:{cid}" for cid in load.samples})
    started = last_move = time.time()
    accounted, now_lags = 0, {}
    with Progress(console=console) as progress:
        task = progress.add_task("settling", total=len(ids))
        while time.time() - started < timeout:
            stored = len(stored_counts(settings).keys() & acknowledged)
            flush(settings)
            now = len(registry.times_learned(ids).keys() | registry.dropped(ids).keys())
            if now != accounted:
                accounted, last_move = now, time.time()
            now_lags = lags(settings, tuple(GROUPS))
            progress.update(task, completed=accounted, description=(
                f"stored {stored:,}/{len(acknowledged):,} events, lags {now_lags}, samples accounted"))
            if stored == len(acknowledged) and accounted == len(ids):
                break
            if not any(now_lags.values()) and time.time() - last_move > 60:
                break
            time.sleep(2)
    return {"waited_s": time.time() - started, "lags_at_end": now_lags, "samples": len(ids),
            "accounted": accounted}


def check(settings: Settings, load: Load, phases: list[dict]) -> None:
    """Each phase's events acknowledged, found, stored twice, and its samples learned twice,
    lost (neither learned nor dropped) and dropped, by id."""
    counts, registry = stored_counts(settings), Registry(settings.policies_dir)
    ids = sorted({f"dev:{cid}" for cid in load.samples})
    learned, dropped = registry.times_learned(ids), registry.dropped(ids)
    phases.append({"fault": "all", "from": 0.0, "to": float("inf"),
                   "recoveries": [r for p in phases for r in p["recoveries"]]})
    for phase in phases:
        mine = {i for t, i in load.acknowledged if phase["from"] <= t < phase["to"]}
        samples = {f"dev:{i.removeprefix('fault-t-')}" for i in mine if i.startswith("fault-t-")}
        phase.update(acknowledged=len(mine), found=sum(1 for i in mine if i in counts),
                     duplicates=sum(1 for i in mine if counts.get(i, 0) > 1), samples=len(samples),
                     learned_twice=sum(1 for s in samples if learned.get(s, 0) > 1),
                     lost=sum(1 for s in samples if not learned.get(s) and s not in dropped),
                     dropped=sum(1 for s in samples if s in dropped and not learned.get(s)),
                     dropped_why=sorted({dropped[s] for s in samples if s in dropped}))


def seconds(values: list[float | None], how: Callable[[list[float]], float]) -> str:
    known = [v for v in values if v is not None]
    text = f"{how(known):.1f}" if known else "-"
    return text + (f" ({len(values) - len(known)} not)" if len(known) < len(values) else "")


def report(phases: list[dict]) -> Table:
    table = Table(title="fault suite: kill -9 under load, brought back by liverl")
    for column in ("fault", "times", "acknowledged", "found", "duplicates", "samples", "learned twice", "lost",
                   "dropped", "recovery p50 s", "recovery max s", "outcome"):
        table.add_column(column, justify="right")
    for p in phases:
        recovered = [r["caught_up_s"] for r in p["recoveries"]]
        table.add_row(p["fault"], str(len(p["recoveries"])), f"{p['acknowledged']:,}", f"{p['found']:,}",
                      str(p["duplicates"]), f"{p['samples']:,}", str(p["learned_twice"]), str(p["lost"]),
                      str(p["dropped"]), seconds(recovered, statistics.median), seconds(recovered, max),
                      p.get("outcome", ""))
    return table


def outcome(fault: str, recoveries: list[dict]) -> str:
    """What the special faults must show, counted: steps reached, replicas verified, canaries ended whole."""
    if fault == "learner steps":
        return f"{sum(r['reached'] for r in recoveries)}/{len(recoveries)} steps reached"
    if fault == "replica mid-swap":
        return f"{sum(bool(r.get('verified')) for r in recoveries)}/{len(recoveries)} back verified"
    if fault == "controller mid-canary":
        ended = ",".join(r.get("ended_as", "not found") for r in recoveries)
        return f"{sum(bool(r.get('consistent')) for r in recoveries)}/{len(recoveries)} whole; ended {ended}"
    return ""


def inject(settings: Settings, faults: list[str], steps: list[str], kills: int, rng: random.Random,
           catch_up_s: float) -> list[dict]:
    """Every fault in turn, each phase timed (its events are those acknowledged meanwhile)."""
    def killing(name: str) -> Callable[[], dict]:
        return lambda: kill(settings, name, catch_up_s)

    def dying_at(step: str) -> Callable[[], dict]:
        return lambda: learner_step(settings, step, catch_up_s)

    plan = [(name, [killing(name)] * kills) for name in faults]
    plan += [("learner steps", [dying_at(step) for step in steps]),
             ("controller mid-canary", [lambda: controller_mid_canary(settings)] * kills),
             ("replica mid-swap", [lambda: replica_mid_swap(settings)] * kills)]
    phases = []
    for fault, injections in plan:
        phase: dict = {"fault": fault, "from": time.time(), "recoveries": []}
        for injection in injections:
            time.sleep(rng.uniform(2, 8))
            phase["recoveries"].append(injection())
            console.print(f"{fault}: {phase['recoveries'][-1]}")
        time.sleep(3)
        phase.update(to=time.time(), outcome=outcome(fault, phase["recoveries"]))
        phases.append(phase)
    return phases


def markdown_rows(phases: list[dict]) -> list[str]:
    rows = []
    for p in phases:
        if p["fault"] == "calibration":
            continue
        recovered = [r["caught_up_s"] for r in p["recoveries"]]
        rows.append(f"| {p['fault']} | {len(p['recoveries'])} | {p['acknowledged']:,} | {p['found']:,} | "
                    f"{p['duplicates']} | {p['learned_twice']} | {p['lost']} | {p['dropped']} | "
                    f"{seconds(recovered, statistics.median)} | {seconds(recovered, max)} | {p.get('outcome', '')} |")
    return rows


def summarise(results: list[Path]) -> None:
    """The docs' tables from the runs' JSON: one per run, then each column's median and range."""
    header = ("| fault | times | events acknowledged | events found | duplicates stored | samples learned twice "
              "| samples lost | samples dropped | recovery p50 s | recovery max s | outcome |\n" + "|---" * 11 + "|")
    runs = [json.loads(path.read_text()) for path in results]
    for path, run in zip(results, runs, strict=True):
        print(f"\n{path.name}: {run['rate']} events/s and {run['samples_per_s']:.1f} samples/s "
              f"(learner measured at {run['learner_samples_per_s']:.1f}/s), seed {run['seed']}, "
              f"{run['seconds'] / 60:.0f} min, refused {run['refused']}\n")
        print(header)
        print("\n".join(markdown_rows(run["phases"])))
    print("\nacross runs, median (min-max):\n")
    print(header)
    for fault in [p["fault"] for p in runs[0]["phases"] if p["fault"] != "calibration"]:
        same = [next(p for p in run["phases"] if p["fault"] == fault) for run in runs]
        cells = [fault, str(len(same[0]["recoveries"]))]
        for key in ("acknowledged", "found", "duplicates", "learned_twice", "lost", "dropped"):
            values = [p[key] for p in same]
            cells.append(f"{statistics.median(values):,.0f} ({min(values):,}-{max(values):,})")
        for how in (statistics.median, max):
            values = [v for p in same if (v := seconds([r["caught_up_s"] for r in p["recoveries"]], how)) != "-"]
            cells.append(" / ".join(values))
        cells.append("; ".join(p.get("outcome", "") for p in same))
        print("| " + " | ".join(cells) + " |")


def main(data_dir: Path = typer.Option(Path("/tmp/liverl-bench-faults"), help="The stack's data directory."),
         port_offset: int = typer.Option(7000, help="Every port moved by this (as LIVERL_TEST_PORT_OFFSET)."),
         kills: int = typer.Option(2, min=1, help="Kills of each process (and replicas mid-swap, controllers "
                                   "mid-canary)."),
         rate: int = typer.Option(300, min=5, help="Feedback events a second the load sends (beside the samples)."),
         samples_share: float = typer.Option(0.5, min=0.05, max=1.0, help="Rewarded samples a second, as a share "
                                             "of the learner's measured rate."),
         faults: list[str] = typer.Option(list(FAULTS), help="The processes to kill at random moments, in turn."),
         steps: list[str] = typer.Option(list(LEARNER_STEPS), help="The learner's durable steps to die at."),
         settle_s: float = typer.Option(600, help="How long the end may wait for every event and sample."),
         catch_up_s: float = typer.Option(90, help="How long a restarted component may take to catch up once "
                                          "healthy (longer: counted as not caught up)."),
         seed: int = typer.Option(0, help="Seed of the random moments."),
         out: Path | None = typer.Option(None, help="Write the table as JSON here.")) -> None:
    rng, started = random.Random(seed), time.time()
    settings = fault_settings(data_dir, port_offset)
    up(settings, say=console.print, progress=False)
    load = Load(settings, rate, 0)
    load.thread.start()
    try:
        calibration: dict = {"fault": "calibration", "from": time.time(), "recoveries": []}
        learner_rate = calibrate(settings, load, 20 * settings.learner.batch_samples)
        load.samples_per_s = samples_share * learner_rate
        calibration["to"] = time.time()
        console.print(f"learner: {learner_rate:.1f} samples/s; load: {rate} events/s and "
                      f"{load.samples_per_s:.1f} samples/s")
        phases = [calibration, *inject(settings, faults, steps, kills, rng, catch_up_s)]
        load.stop.set()
        load.thread.join(timeout=60)
        # What was acknowledged, kept beside the stack: the check can be made again by hand.
        run = {"refused": load.refused, "rate": rate, "samples_per_s": load.samples_per_s,
               "learner_samples_per_s": learner_rate, "samples_share": samples_share, "kills": kills,
               "seed": seed, "started": started}
        (data_dir / "fault-load.json").write_text(json.dumps({"acknowledged": load.acknowledged,
                                                              "samples": load.samples, "phases": phases, "run": run}))
        finish(settings, load, phases, run, settle_s, out)
    finally:
        load.stop.set()
        down(settings, say=console.print, force=True)


def finish(settings: Settings, load: Load, phases: list[dict], run: dict, settle_s: float, out: Path | None) -> None:
    """The end of a run: settle, check, the table, the JSON."""
    settled = settle(settings, load, settle_s)
    check(settings, load, phases)
    console.print(report(phases))
    console.print(f"refused (503 or no answer, the client's to send again): {run['refused']}; settled: {settled}")
    if out:
        out.write_text(json.dumps({"phases": phases, **run, "settled": settled,
                                   "seconds": time.time() - run["started"]}, indent=2))


def resume(data_dir: Path, port_offset: int, settle_s: float, out: Path) -> None:
    """A run whose end failed, finished on its data directory: the stack started again on
    what it kept (the broker's topics, ClickHouse, the registry), then settled and checked
    against what was acknowledged (`fault-load.json`)."""
    settings = fault_settings(data_dir, port_offset)
    saved = json.loads((data_dir / "fault-load.json").read_text())
    up(settings, say=console.print, progress=False)
    try:
        load = Load(settings, 0, 0)
        load.acknowledged, load.samples = [tuple(a) for a in saved["acknowledged"]], saved["samples"]
        finish(settings, load, saved["phases"], saved["run"], settle_s, out)
    finally:
        down(settings, say=console.print, force=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["summarise"]:  # the docs' tables from earlier runs' JSON
        summarise([Path(a) for a in sys.argv[2:]])
    elif sys.argv[1:2] == ["resume"]:  # resume DATA_DIR PORT_OFFSET OUT
        resume(Path(sys.argv[2]), int(sys.argv[3]), 600, Path(sys.argv[4]))
    else:
        typer.run(main)
