"""The capacity scheduler: idle serving replicas are lent to rollouts and taken back the
moment production traffic returns.

It reads production load from the gateway's own numbers (`/admin/load`: requests in
flight per replica and waiting for one, and completion tokens answered per second) every
`capacity.poll_s`, per production replica.

- Lend, after the load stayed below `lend_below` (and tokens/s below
  `lend_below_tokens_per_s`, if set) for `lend_after_s`, keeping at least
  `min_production_replicas`, never while a canary is judged or waits for a replica: the
  learner's newest version is staged while the replica still serves, it leaves
  production rotation (disabled), finishes what it answers, is marked lent (alias
  `rollout`: the gateway sends no production request there), moves to that version
  through the verified swap (rollouts are on-policy, not stale), and is enabled for the
  rollout worker.
- Take back, as soon as the load passes `take_back_above` (above `lend_below`: a load
  between the two changes nothing, so it does not flap) or a canary needs the replica:
  disabled (the worker starts nothing new there), its in-flight rollouts aborted
  (vLLM's `/abort_requests`: their groups are cut, never trained half-scored), swapped
  back to stable if it serves another version, then returned to production. The
  take-back time runs from the last load reading that did not ask for it to that moment,
  and one over `take_back_bound_s` is logged as a warning and counted. So that the swap
  back only loads weights, a lent replica keeps stable's staged beside the versions it
  serves (`ReplicaSync.keep`), restaged in the background when stable changes during
  the lend.

- Refresh: a lent replica follows the learner's newest version, so rollouts stay
  on-policy. `capacity.refresh = timer` moves it every `refresh_s`, cutting the groups
  still running after the drain; `between_groups` moves it as soon as its last group ends,
  since the rollout worker starts none on a replica behind the learner.

The waits inside a lend or a refresh (in-flight requests finishing, up to
`serving.swap_drain_s`) keep reading the load: production returning ends them at once,
the lend is given up and a refreshing replica taken straight back, not swapped first.

Every lend and take-back, with the load that caused it, is appended to
`run/capacity.jsonl` (`liverl status` shows the latest), counted in
`liverl_capacity_events_total`, and published for ClickHouse's `capacity_events`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
from fastapi import Depends, FastAPI, Query
from prometheus_client import Counter, Gauge

from liverl.audit import Reason
from liverl.contracts import CapacityEvent, Topics
from liverl.http import Audit, service_app
from liverl.kafka import encode, produce_sync
from liverl.keys import KeyRecord, require_admin
from liverl.lending import hold_lending, lending_state, read_pause, record_event
from liverl.load import GatewayLoad, read_gateway_load
from liverl.observability import log, setup_logging
from liverl.pool import ROLLOUT, Pool, Replica, edit_pool, read_pool, replica_client, replica_lock, set_replica
from liverl.process import serve_beside
from liverl.settings import CapacityConfig, Settings, get_settings
from policies.registry import PolicyVersion, Registry
from serving.swap import SwapReport, in_flight, replace_replica
from sync.replica import ReplicaSync

EVENTS = Counter("liverl_capacity_events_total", "Replicas lent to and taken back from rollouts", ["action"])
LENT = Gauge("liverl_capacity_lent_replicas", "Replicas lent to rollouts now")
STEP_ERRORS = Counter("liverl_capacity_step_errors_total", "Scheduler looks that raised (logged; it looks again)")
OVER_BOUND = Counter("liverl_capacity_take_backs_over_bound_total", "Take-backs slower than capacity.take_back_bound_s")
logger = setup_logging("capacity")


@dataclass(frozen=True)
class Decision:
    action: Literal["lend", "take_back"]
    replica: str
    load: float  # production requests in flight and waiting, per production replica
    why: str
    tokens_per_s: float = 0.0  # production completion tokens answered per second, per production replica


def production_load(load: GatewayLoad, pool: Pool) -> float:
    """Requests in flight on production replicas, plus those waiting, per production replica."""
    production = [r for r in pool.general if r.enabled]
    busy = sum(load.in_flight.get(r.name, 0) for r in pool.general) + load.waiting
    return busy / max(len(production), 1)


def production_tokens_per_s(load: GatewayLoad, pool: Pool) -> float:
    """Completion tokens production was answered per second, per production replica."""
    return load.tokens_per_s / max(len([r for r in pool.general if r.enabled]), 1)


class Hysteresis:
    """When to lend and when to take back, from successive load samples."""

    def __init__(self, config: CapacityConfig):
        self.config = config
        self.quiet_since: float | None = None

    def decide(self, now: float, load: GatewayLoad, pool: Pool, canary_wanted: bool,
               backing_off: frozenset[str] = frozenset(), paused: str | None = None) -> Decision | None:
        """Lend, take back (a lent replica not in `backing_off`: its last take-back failed a
        moment ago), or nothing. `paused`: why on-call paused lending (every lent replica
        comes back, whatever the load, and none is lent)."""
        busy, tokens = production_load(load, pool), production_tokens_per_s(load, pool)
        takeable = [r for r in pool.lent if r.name not in backing_off]
        if stuck := [r for r in takeable if not r.enabled]:  # a take-back that failed is finished, whatever the load
            return Decision("take_back", stuck[0].name, busy, "retrying a take-back whose swap failed", tokens)
        if takeable and (paused or busy > self.config.take_back_above or canary_wanted):
            self.quiet_since = None
            why = paused or (f"load {busy:.2f} per production replica > {self.config.take_back_above}"
                             if busy > self.config.take_back_above else "a canary needs the replica")
            return Decision("take_back", takeable[0].name, busy, why, tokens)
        tokens_limit = self.config.lend_below_tokens_per_s
        if paused or busy > self.config.lend_below or (tokens_limit is not None and tokens > tokens_limit):
            self.quiet_since = None
            return None
        self.quiet_since = now if self.quiet_since is None else self.quiet_since
        production = [r for r in pool.general if r.enabled]
        spare = [r for r in production if r.policy_version == pool.aliases.get("stable")]
        if (now - self.quiet_since < self.config.lend_after_s or canary_wanted or "canary" in pool.aliases
                or len(production) - 1 < self.config.min_production_replicas or not spare):
            return None
        self.quiet_since = now  # the next lend waits for a quiet period of its own
        quietest = min(spare, key=lambda r: load.in_flight.get(r.name, 0))
        return Decision("lend", quietest.name, busy,
                        f"load {busy:.2f} per production replica <= {self.config.lend_below} "
                        f"for {self.config.lend_after_s:.0f} s", tokens)


class Scheduler:
    def __init__(self, settings: Settings):
        self.settings, self.config = settings, settings.capacity
        self.registry = Registry(settings.policies_dir)
        self.rules = Hysteresis(self.config)
        self.refreshed: dict[str, float] = {}
        self.staged_ahead: dict[str, str] = {}  # lent replica -> the version staged for its next move
        self.retry_at: dict[str, float] = {}  # replica -> when a failed take-back may be tried again
        # A replica's stagings share its work directory: one at a time (swaps and keeping stable).
        self.staging = threading.Lock()
        self.keeper = ThreadPoolExecutor(1, thread_name_prefix="keep-stable")
        self.keeping: Future | None = None
        self.keep_retry_at: dict[tuple[str, str | None], float] = {}  # (replica, version) that failed to stage
        # The last load reading that asked for no take-back: a take-back is timed from it, since
        # the load rose at some moment after it (a lend or a refresh under way delays the next).
        self.calm_at: float | None = None
        self.returned_load = 0.0  # the load of the reading that ended a drain (`production_returned`)
        self.http = httpx.Client()  # one for every load reading (see read_gateway_load)

    def gateway_load(self) -> GatewayLoad:
        return read_gateway_load(self.settings, self.http)

    def canary_wanted(self, pool: Pool) -> bool:
        """The promotion controller has a candidate for the live guard, which needs two
        production replicas: production wins over rollouts."""
        promotion = self.settings.promotion
        if not (promotion.auto_promote and promotion.canary_guard) or len(pool.general) >= 2:
            return False
        if self.registry.pinned():  # the controller starts no canary then: taking one back would only flap
            return False
        stable = self.registry.stable()
        return any((c.metrics.get("gate") or {}).get("passed") and (stable is None or c.seq > stable.seq)
                   for c in self.registry.in_state("candidate"))

    def rollout_version(self) -> PolicyVersion:
        """The learner's newest version (its chain's head), which rollouts sample from."""
        return self.registry.rollout_version()

    def stable_version(self) -> str:
        """Stable's name in the registry (a version leaves stable only for another)."""
        stable = self.registry.stable()
        assert stable is not None, "the registry always has a stable version"
        return stable.version

    def production_returned(self) -> bool:
        """One more load reading, for a wait that holds the loop: whether production's load
        has passed `take_back_above` (`returned_load`). A calm reading moves `calm_at` on."""
        self.returned_load = production_load(self.gateway_load(), read_pool(self.settings))
        if self.returned_load > self.config.take_back_above:
            return True
        self.calm_at = time.time()
        return False

    def drain(self, url: str) -> bool:
        """A replica out of rotation finishes its requests (up to `serving.swap_drain_s`);
        False, at once, if production returns meanwhile."""
        deadline = time.time() + self.settings.serving.swap_drain_s
        while not self.production_returned():
            try:
                if in_flight(url) == 0:
                    return True
            except httpx.HTTPError:  # an engine that does not answer drains nothing: wait out the deadline
                pass
            if time.time() >= deadline:
                return True  # what still runs is paused (a lend) or aborted (a refresh)
            time.sleep(0.05)
        return False

    def stage_ahead(self, name: str, version: PolicyVersion) -> None:
        """Rebuild `version` in the replica's directory while it still serves, so that its
        swap only loads, and the time it holds the loop and is out of rotation is short."""
        if (self.settings.sync.transport != "delta"
                or read_pool(self.settings).get(name).policy_version == version.version):
            return
        with self.staging:
            try:
                ReplicaSync.of(self.settings, name).stage(version.version)
            except Exception as error:  # the swap stages it again, or loads the registry's directory
                log(logger, "could not stage ahead", replica=name, version=version.version, error=repr(error))

    def lend(self, decision: Decision, asked_at: float) -> CapacityEvent | None:
        """The replica lent, serving the learner's newest version; None if, once no one
        else could move it, it was no longer a spare stable replica (the controller made it
        a canary meanwhile) or production returned while it finished its requests."""
        version = self.rollout_version()
        self.stage_ahead(decision.replica, version)
        with replica_lock(self.settings, decision.replica):
            pool = read_pool(self.settings)
            replica = pool.get(decision.replica)
            if (replica.alias is not None or not replica.enabled or "canary" in pool.aliases
                    or replica.policy_version != pool.aliases.get("stable")):
                log(logger, "lend given up: the replica is no longer a spare stable one", replica=replica.name)
                return None
            set_replica(self.settings, replica.name, enabled=False)
            if not self.drain(replica.url):
                set_replica(self.settings, replica.name, enabled=True)
                log(logger, "lend given up: production returned", replica=replica.name)
                return None
            set_replica(self.settings, replica.name, alias=ROLLOUT)
            self.keep_stable(replica.name)  # it serves stable now: nothing to stage, only to keep
            report = self.move(replica.name, version)
            set_replica(self.settings, replica.name, enabled=True)
        self.refreshed[replica.name] = time.time()
        return self.event("lend", decision, read_pool(self.settings).get(replica.name).policy_version,
                          time.time() - asked_at, report.error if report is not None else None,
                          steps=swap_steps(report))

    def take_back(self, decision: Decision, asked_at: float) -> CapacityEvent:
        with replica_lock(self.settings, decision.replica):
            replica = set_replica(self.settings, decision.replica, enabled=False)
            started = time.time()
            aborted = abort_rollouts(replica.url)
            steps = {"abort_s": time.time() - started}
            version, report, error = self.back_to_stable(replica.name)
        seconds = time.time() - asked_at
        self.keep_stable(replica.name)  # back in production: nothing more to keep
        return self.event("take_back", decision, version, seconds, error, aborted, steps=steps | swap_steps(report))

    def back_to_stable(self, name: str, tries: int = 3) -> tuple[str, SwapReport | None, str | None]:
        """A lent replica swapped to stable and returned to production in one pool write
        that checks stable has not moved meanwhile (a promotion finishing, which left the
        lent replica out: it swaps again, onto the new one). The version, the last swap's
        report and the error, if any (it then stays lent and disabled, for the next look)."""
        report = None
        for _ in range(tries):
            stable = self.registry.get(read_pool(self.settings).aliases.get("stable") or self.stable_version())
            report = self.move(name, stable, enable=False) or report  # enabled below, once no longer lent
            if report is not None and report.error:
                return stable.version, report, report.error
            with edit_pool(self.settings) as pool:
                if pool.aliases.get("stable", stable.version) == stable.version:
                    pool.replicas = [r.model_copy(update={"alias": None, "enabled": True}) if r.name == name else r
                                     for r in pool.replicas]
                    return stable.version, report, None
        return stable.version, report, f"stable moved {tries} times while the replica was swapped back to it"

    def move(self, name: str, version: PolicyVersion, enable: bool = True) -> SwapReport | None:
        """Swap a replica out of production to `version`, verified (its report: `error` set if
        it failed); None if it serves `version` already."""
        if read_pool(self.settings).get(name).policy_version == version.version:
            return None
        with self.staging:
            return replace_replica(self.settings, name, version.version, Path(version.model_dir), enable)

    def keep_stable(self, name: str) -> None:
        """A lent replica keeps stable's weights staged, so its take-back only loads them;
        a production replica keeps nothing extra."""
        if self.settings.sync.transport != "delta":
            return
        with self.staging:  # and so after any take-back that was under way
            stable = self.registry.stable()
            lent = read_pool(self.settings).get(name).alias == ROLLOUT
            wanted = stable.version if lent and stable is not None else None
            replica = ReplicaSync.of(self.settings, name)
            if replica.state().kept == wanted or time.time() < self.keep_retry_at.get((name, wanted), 0.0):
                return
            try:
                replica.keep(wanted)
            except Exception as error:  # the take-back stages stable itself, only slower
                # Not again at every poll (a version the delta store never had fails every time).
                self.keep_retry_at[(name, wanted)] = time.time() + self.config.retry_s
                log(logger, "could not keep stable staged", replica=name, error=repr(error),
                    retry_in_s=self.config.retry_s)

    def refresh(self) -> Decision | None:
        """Lent replicas follow the learner's newest version (`capacity.refresh`: every
        `refresh_s`, or between groups); a take-back instead if production returns while a
        replica finishes its groups."""
        newest = self.rollout_version()
        lent = read_pool(self.settings).lent
        if lent and (self.keeping is None or self.keeping.done()):
            def keep_lent() -> None:
                for r in lent:
                    self.keep_stable(r.name)

            self.keeping = self.keeper.submit(keep_lent)
        for replica in lent:
            if not replica.enabled or replica.policy_version == newest.version:  # disabled: being taken back
                continue
            if self.config.refresh == "between_groups":
                self.move_between_groups(replica, newest)
            elif time.time() - self.refreshed.get(replica.name, 0) >= self.config.refresh_s:
                # A group is sampled on one version: no new group starts, those running finish
                # (up to swap_drain_s) and the rest are aborted (cut), so none runs on under the
                # new weights with the old version's label.
                self.stage_ahead(replica.name, newest)
                set_replica(self.settings, replica.name, enabled=False)
                if not self.drain(replica.url):
                    return Decision("take_back", replica.name, self.returned_load,
                                    "production returned during a refresh")
                abort_rollouts(replica.url)
                self.move(replica.name, newest)
                set_replica(self.settings, replica.name, enabled=True)
                self.refreshed[replica.name] = time.time()
        return None

    def move_between_groups(self, replica: Replica, newest: PolicyVersion) -> None:
        """The rollout worker starts no group on a replica behind the learner
        (`capacity.refresh = between_groups`): stage the newest version while its last
        groups finish, and swap once none runs, so no group is cut."""
        if self.staged_ahead.get(replica.name) != newest.version:
            self.stage_ahead(replica.name, newest)
            self.staged_ahead[replica.name] = newest.version
        try:
            if in_flight(replica.url) > 0:
                return
        except httpx.HTTPError:  # an engine that does not answer: looked at again at the next poll
            return
        set_replica(self.settings, replica.name, enabled=False)
        self.move(replica.name, newest)
        set_replica(self.settings, replica.name, enabled=True)
        self.refreshed[replica.name] = time.time()

    def event(self, action: Literal["lend", "take_back"], decision: Decision, version: str, seconds: float,
              error: str | None, aborted: int | None = None, steps: dict[str, float] | None = None) -> CapacityEvent:
        bound = self.config.take_back_bound_s if action == "take_back" else None
        event = CapacityEvent(action=action, replica=decision.replica, policy_version=version,
                              load=decision.load, tokens_per_s=decision.tokens_per_s, why=decision.why,
                              seconds=seconds, bound_s=bound, error=error, aborted_requests=aborted,
                              steps=steps or {})
        EVENTS.labels(action).inc()
        if bound is not None and seconds > bound:
            OVER_BOUND.inc()
            logger.warning("take-back over its bound", extra={"fields": dict(
                replica=decision.replica, seconds=round(seconds, 3), bound_s=bound, steps=event.steps)})
        LENT.set(len(read_pool(self.settings).lent))
        record_event(self.settings, event)
        try:
            produce_sync(self.settings, Topics.CAPACITY, encode(event))
        except Exception as publish_error:  # the log file and the metric have it; analytics may be down
            log(logger, "could not publish", error=repr(publish_error))
        log(logger, action, replica=decision.replica, version=version, load=round(decision.load, 2),
            seconds=round(seconds, 3), why=decision.why, error=error)
        return event

    def step(self) -> CapacityEvent | None:
        asked_at = time.time()
        pool = read_pool(self.settings)
        # A replica whose swap back failed a moment ago is not tried again at every poll.
        backing_off = frozenset(name for name, at in self.retry_at.items() if time.time() < at)
        load = self.gateway_load()
        # A canary is judged on production traffic: in a trough too quiet to judge one it could
        # only wait, so a candidate does not take a replica back from rollouts until traffic returns.
        canary = load.requests_per_s > self.settings.promotion.quiet_requests_per_s and self.canary_wanted(pool)
        paused = read_pause(self.settings)
        why_paused = f"lending paused by {paused.actor}: {paused.reason}" if paused is not None else None
        decision = self.rules.decide(time.monotonic(), load, pool, canary, backing_off, why_paused)
        busy = production_load(load, pool)
        if decision is None or decision.action != "take_back":
            self.calm_at = asked_at
        elif busy > self.config.take_back_above and self.calm_at is not None:
            asked_at = self.calm_at
        # A refresh holds the loop: only while quiet, and not while lending is paused.
        if decision is None and not paused and busy <= self.config.lend_below:
            decision = self.refresh()
            assert self.calm_at is not None, "set above; a refresh only moves it on"
            asked_at = self.calm_at  # a take-back if production returned: from the last calm reading
        if decision is None:
            return None
        event = (self.lend if decision.action == "lend" else self.take_back)(decision, asked_at)
        if event is not None and event.action == "take_back" and event.error:
            self.retry_at[decision.replica] = time.time() + self.config.retry_s
        return event

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.step()
            except httpx.HTTPError as error:  # the gateway restarting: lend nothing meanwhile
                log(logger, "no load reading", error=repr(error))
            except Exception as error:  # a dead scheduler would strand lent replicas: log, look again
                STEP_ERRORS.inc()
                logger.exception(f"capacity step failed: {error!r}")
            stop.wait(self.config.poll_s)


def swap_steps(report: SwapReport | None) -> dict[str, float]:
    """Where a lend's or take-back's swap spent its time (nothing if there was no swap)."""
    if report is None:
        return {}
    return {"fetch_s": report.fetch_s, "decode_s": report.decode_s, "drain_s": report.drain_s,
            "load_s": report.load_s, "verify_s": report.verify_s, "swap_out_of_rotation_s": report.pause_s}


def abort_rollouts(url: str) -> int | None:
    """Abort every request a lent replica runs (only rollouts reach it); how many it had."""
    try:
        running = int(in_flight(url))
        with replica_client(url, timeout=5) as http:
            http.post("/abort_requests", json={}).raise_for_status()
        return running
    except httpx.HTTPError:
        return None


def create_app(scheduler: Scheduler) -> FastAPI:
    settings = scheduler.settings

    def health() -> dict:
        return {"ok": True, **lending_state(settings, latest=1)}

    app = service_app("liverl capacity scheduler", settings, health)

    @app.post("/admin/{verb}")
    def pause_or_resume(verb: Literal["pause", "resume"], body: Reason, audit: Audit,
                        key: KeyRecord = Depends(require_admin),
                        wait_s: float = Query(30.0, ge=0, le=600, description="How long a pause waits for the "
                                              "lent replicas to come back.")) -> dict:
        """Pause: lend nothing and take every lent replica back, whatever the load, until
        resumed (kept across restarts); answers once no replica is lent, or after `wait_s`
        with those still lent. Resume: lend again once the load allows (after `lend_after_s`
        of quiet, as ever). Admin key; audited."""
        return hold_lending(settings, audit, key.key_id, verb, body.reason, wait_s)

    return app


if __name__ == "__main__":
    settings = get_settings()
    scheduler = Scheduler(settings)
    serve_beside(create_app(scheduler), settings.host, settings.ports.capacity, scheduler.run)
