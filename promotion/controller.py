"""The promotion controller: candidates to canary, canaries to stable or aborted, and a
guard on stable itself. A process of its own (`liverl up` starts it), so the learner
never waits for a canary and a learner restart never interrupts one.

- The newest candidate that passed the offline gate (and was not trained on top of a
  version taken off users) goes to one replica: the canary, beside stable on the others.
- The canary guard judges it on live feedback (`promotion/sequential.py`): the judged
  production completions canary and stable served since the canary started, compared
  on accept rate and mean reward with an always-valid test, so looking every second is
  sound. Clearly worse on either: `aborted`, its replica back on stable, and the learner
  asked to rewind to stable. Non-inferior within the margins on both: stable on every
  replica. Undecided after `canary_refresh_samples` with a newer candidate waiting (or
  sooner, when at the rate its intervals narrow it would still have no verdict then):
  the newer one takes its place. Neither by `max_samples` or `max_canary_s`: aborted as
  inconclusive.
- The skill guard: before its canary, a candidate is judged on each held-out evaluation
  (the evaluator's figures, task by task) against the starter and stable (or the best recent one);
  one that surely lost skill is held (rejected, the learner asked to rewind), since users'
  feedback cannot show it and a version users like may still have forgotten what rollouts
  taught.
- The slide guard: small steps can add up to a decline no single comparison calls
  significant. Stable's served accept rate is compared with that of each of the last
  `slide_lookback` stables over their own time as stable; when it is surely more than
  `slide_margin` below the best, that version is put back and the learner rewinds to it.

Killed at any line, a restart finds the canary in the registry (its start time is in
its metrics) and judges it again from ClickHouse's figures, not from memory. A replica
that a killed process (this one, or the capacity scheduler mid-lend) left out of
rotation with nobody working on it is reloaded, verified and put back
(`serving.swap.restore_abandoned`), and the new engine of a blue/green swap it left
unverified is stopped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from liverl.keys import admin_headers
from liverl.load import read_gateway_load
from liverl.observability import log, setup_logging
from liverl.pool import promotion_lock, read_pool
from liverl.settings import Settings
from policies.registry import HELDOUT_REGRESSION, Pin, PolicyVersion, Registry
from promotion.promoter import Promoter
from promotion.sequential import (
    Arm,
    Comparison,
    SkillComparison,
    compare,
    compare_skill,
    confidence_sequence,
    verdict_in_sight,
)
from serving.swap import restore_abandoned, stop_abandoned_engines
from sync.replica import ReplicaSync

ACTOR = "controller"
logger = setup_logging("controller")


class Figures:
    """Per version, the arms of the comparison: judged completions (accept rate) and
    rewarded ones (mean reward), summed over tenants, from the sink's `/figures`."""

    def __init__(self, rows: list[dict]):
        self.accept: dict[str, Arm] = {}
        self.reward: dict[str, Arm] = {}
        self.tenant_accept: dict[str, dict[str, Arm]] = {}  # tenant -> version -> its judged completions
        for row in rows:
            v = row["policy_version"]
            self.accept.setdefault(v, Arm()).add(row["judged"], row["accepted"], row["accepted"])  # 0/1: x^2 = x
            self.reward.setdefault(v, Arm()).add(row["samples"], row["reward_sum"], row["reward_squares"])
            self.tenant_accept.setdefault(row["tenant"], {}).setdefault(v, Arm()).add(
                row["judged"], row["accepted"], row["accepted"])


def utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


class QuietWatch:
    """Whether production traffic has been too thin to judge a canary on for `quiet_s`:
    the gateway routed at most `per_s` requests a second at every look since then. Read
    live from the gateway, not from the warehouse: at a peak on shared cores the sink may
    be tens of seconds behind, and its stored answers stand still while users are served."""

    def __init__(self, quiet_s: float, per_s: float = 0.0):
        self.quiet_s = quiet_s
        self.per_s = per_s
        self.key: str | None = None  # what is watched (the canary)
        self.busy_at = 0.0  # the last look with traffic (or the watch's first look)

    def quiet(self, key: str, requests_per_s: float, now: float) -> bool:
        if key != self.key:
            self.key, self.busy_at = key, now
        if requests_per_s > self.per_s:
            self.busy_at = now
        return now - self.busy_at >= self.quiet_s


@dataclass
class Look:
    """The canary guard's look at a canary: its verdict, the comparisons behind it, and
    what is recorded on the version (`info`)."""

    verdict: str  # continue, non_inferior, worse, held or inconclusive
    comparisons: list[Comparison]
    canary_n: int
    age: float
    info: dict


class Controller:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.config = settings.promotion
        self.registry = Registry(settings.policies_dir)
        self.promoter = Promoter(settings, self.registry)
        self.state = "starting"  # what it is doing, for /health
        self.last_error: str | None = None
        self.waiting: str | None = None  # the candidate that waits, logged once
        self.next_slide_check = 0.0
        self.next_heldout_check = 0.0
        self.next_restore_check = 0.0
        self.heldout_checked: str | None = None  # the stable the held-out watch last compared
        self.heldout_regressed = False  # ... and whether it had lost the skill (alerted once per spell)
        self.quiet = (QuietWatch(self.config.quiet_canary_s, self.config.quiet_requests_per_s)
                      if self.config.quiet_canary_s else None)
        # One change at a time: the loop's look and on-call's commands (the admin API).
        self.lock = threading.RLock()
        self.http = httpx.Client()  # the sink's figures and the gateway's load, every look: one client
        self.staged: tuple[str, set[tuple[str, str]]] = ("", set())  # the canary, (replica, version) staged beside it

    @property
    def judge_after_s(self) -> float:
        after = self.config.judge_after_s
        return self.settings.feedback.reward_window_s if after is None else after

    def figure_rows(self, versions: list[str], since: float, until: float, bucket_s: int | None = None) -> list[dict]:
        """The sink's `/figures`: per version and tenant (and time bucket), judged production completions."""
        response = self.http.post(self.settings.url(self.settings.ports.sink) + "/figures", timeout=30,
                                  headers=admin_headers(self.settings),
                                  json={"versions": versions, "since": utc(since), "until": utc(until),
                                        "bucket_s": bucket_s})
        response.raise_for_status()
        return response.json()

    def figures(self, versions: list[str], since: float, until: float) -> Figures:
        return Figures(self.figure_rows(versions, since, until))

    def production_requests_per_s(self) -> float:
        """Production requests the gateway routed per second lately (its `/admin/load`);
        infinite when it does not answer: unknown, behave as without the thin-traffic rules."""
        try:
            return read_gateway_load(self.settings, self.http).requests_per_s
        except httpx.HTTPError:
            return float("inf")

    def production_traffic(self) -> bool:
        """Whether there is enough production traffic to judge a canary on."""
        return self.production_requests_per_s() > self.config.quiet_requests_per_s

    def serving_figures(self, versions: list[str], since: float, until: float) -> dict[str, dict]:
        """The sink's `/serving-figures`: per version, answers, server errors, p50 and p99 latency."""
        response = self.http.post(self.settings.url(self.settings.ports.sink) + "/serving-figures", timeout=30,
                                  headers=admin_headers(self.settings),
                                  json={"versions": versions, "since": utc(since), "until": utc(until)})
        response.raise_for_status()
        return {row["policy_version"]: row for row in response.json()}

    def serving_checks(self, rows: dict[str, dict], stable: str, canary: str) -> list[Comparison]:
        """Whatever users thought of them, the canary's answers must not fail more often
        (the always-valid test on the share of answers without a server error) nor be much
        slower (p99 latency within `latency_p99_ratio` of stable's: a fixed threshold, as a
        quantile has no running test here). These only ever find a canary worse."""
        if stable not in rows or canary not in rows:
            return []
        s, c, config = rows[stable], rows[canary], self.config
        checks = []
        if config.error_check:
            ok = [Arm(n=r["requests"], total=r["requests"] - r["errors"], squares=r["requests"] - r["errors"])
                  for r in (s, c)]
            checks.append(compare("success_rate", *ok, alpha=config.false_abort_rate, tau=config.mixture_sd,
                                  margin=0.0, min_samples=config.min_samples))
        if config.latency_p99_ratio is not None:
            enough = min(s["requests"], c["requests"]) >= config.latency_min_requests
            slow = enough and c["p99_ms"] > config.latency_p99_ratio * s["p99_ms"]
            difference = c["p99_ms"] - s["p99_ms"]
            checks.append(Comparison(metric="latency_p99_ms", decision="worse" if slow else "continue",
                                     canary_n=c["requests"], stable_n=s["requests"], canary_mean=c["p99_ms"],
                                     stable_mean=s["p99_ms"], difference=difference, low=difference, high=difference))
        return checks

    def alert(self, event: str, version: str, reason: str, **figures: object) -> None:
        """Tell a human, without waiting for them: POST the event to the alert webhook
        (payload in docs/production.md). A webhook that fails is logged, never retried
        into the controller's loop."""
        log(logger, "alert", alert=event, version=version, reason=reason)
        if self.config.alert_webhook is None:
            return
        stable = self.registry.stable()
        payload = {"event": event, "version": version, "stable": stable.version if stable else None,
                   "reason": reason, "at": utc(time.time()), "actor": ACTOR, **figures}

        def send() -> None:
            try:
                httpx.post(str(self.config.alert_webhook), json=payload,
                           timeout=self.config.alert_timeout_s).raise_for_status()
            except httpx.HTTPError as error:
                log(logger, "alert not delivered", alert=event, error=repr(error))

        threading.Thread(target=send, daemon=True).start()

    # --- one look ----------------------------------------------------------------------------
    def step(self) -> None:
        if time.time() >= self.next_restore_check:  # not every poll: a failed restore restarts a replica
            self.next_restore_check = time.time() + 10 * self.config.poll_s
            for name, back in restore_abandoned(self.settings).items():
                log(logger, "a replica left out of rotation by a killed process", replica=name,
                    back_in_production=back)
            for engine in stop_abandoned_engines(self.settings):
                log(logger, "stopped the new engine of a blue/green swap a killed process left",
                    replica=engine.name, version=engine.policy_version, pid=engine.pid)
        if self.config.heldout_watch:
            self.watch_heldout()
        if canaries := self.registry.in_state("canary"):
            for older in canaries[:-1]:  # one canary at a time; a crash may have left two
                self.promoter.abort(older.version, ACTOR, f"{canaries[-1].version} is the canary")
            self.ask_ahead(canaries[-1])
            return self.judge(canaries[-1])
        if pin := self.registry.pinned():
            self.state = f"stable pinned at {pin.version} by {pin.actor}: {pin.reason}"
            return
        if self.config.canary_guard and time.time() >= self.next_slide_check:
            self.next_slide_check = time.time() + 10 * self.config.poll_s
            self.guard_slide()
        if self.config.auto_promote:
            self.take_candidate()
        else:
            self.state = "idle (auto_promote off)"
        self.serve_stable_everywhere()

    def take_candidate(self) -> None:
        stable = self.registry.stable()
        eligible = []
        for candidate in self.registry.in_state("candidate"):
            if bad := self.registry.continues_rejected(candidate.version):
                self.promoter.transition(candidate.version, "rejected", ACTOR,
                                         f"trained on top of {bad}, which was taken off users")
            elif held := self.continues_held(candidate.version):
                self.promoter.transition(candidate.version, "rejected", ACTOR,
                                         f"trained on top of {held}, held for skill")
            elif stable is None or candidate.seq > stable.seq:
                eligible.append(candidate)
        if not eligible:
            self.state = "idle"
            return
        newest = self.skill_scored(eligible) or eligible[-1]
        older = [c for c in eligible if c.seq < newest.seq]  # only the newest is worth a canary ...
        if "heldout" not in newest.metrics and self.evaluator_answers():
            older = []  # ... but not one nobody scored: the one the evaluator scores now would be lost
        for version in older:
            self.promoter.transition(version.version, "superseded", ACTOR, f"{newest.version} is newer")
        gate = newest.metrics.get("gate")
        if not gate or not gate["passed"]:
            if self.waiting != newest.version:
                self.waiting = newest.version
                log(logger, "candidate waits", version=newest.version,
                    reason=gate["reason"] if gate else "no held-out samples yet")
            self.state = f"{newest.version} waits for the offline gate"
            return
        if stable is not None and not self.skill_passed(newest, stable):
            return
        thin_traffic_waits = self.quiet is not None or self.config.quiet_requests_per_s > 0
        if thin_traffic_waits and self.config.canary_guard and not self.production_traffic():
            self.state = f"{newest.version} waits for production traffic to judge a canary on"
            return
        if self.config.canary_guard and len(read_pool(self.settings).general) < 2:
            self.state = ("refusing canaries: the live guard compares a canary with stable on a second "
                          "replica (serving.replicas >= 2, or promotion.canary_guard=false)")
            return
        try:
            # Recorded first, so a restart after the swap knows this canary is the controller's
            # (and finishes it: without the guard, `judge` goes on to every replica).
            if stable is not None:
                self.registry.update_metrics(newest.version, canary={"started_at": time.time(),
                                                                     "stable": stable.version})
            if not self.config.canary_guard:
                self.state = f"promoting {newest.version}"
                result = self.promoter.promote(newest.version, ACTOR)
                log(logger, "promotion finished", version=newest.version, state=result.state)
                return
            self.state = f"starting canary {newest.version}"
            assert stable is not None, "a canary is judged against stable"
            canary = self.promoter.start_canary(newest.version, ACTOR,
                                                "offline gate passed; judged live against stable")
        except Exception as error:
            return self.fail(newest.version, f"{type(error).__name__}: {error}")
        if canary.state == "canary":  # compared from when it serves
            self.registry.update_metrics(newest.version, canary={"started_at": time.time(), "stable": stable.version})
            log(logger, "canary started", version=newest.version, stable=stable.version)

    def fail(self, version: str, error: str) -> None:
        """A promotion that raised: recorded on the version, which is taken out of the
        running (rolled back from canary, rejected as a candidate), and every replica goes
        back to stable. The controller carries on with the next candidate."""
        log(logger, "promotion failed", version=version, error=error)
        self.registry.update_metrics(version, promotion_error=error)
        if self.registry.get(version).state == "canary":
            self.promoter.abort(version, ACTOR, f"promotion failed: {error}", state="rolled_back")
        elif self.registry.get(version).state == "candidate":
            self.promoter.transition(version, "rejected", ACTOR, f"promotion failed: {error}")
        self.alert("promotion_failed", version, error)
        self.last_error = f"{version}: {error}"[:500]  # last: /health shows it once it is all recorded

    def judge(self, canary: PolicyVersion) -> None:
        stable = self.registry.stable()
        info = canary.metrics.get("canary") or {}
        if "started_at" not in info or stable is None:
            # Not the controller's: `liverl policy promote` put it there and finishes it.
            self.state = f"{canary.version} is in canary by hand; left to whoever put it there"
            return
        pin = self.registry.pinned()
        if not self.config.canary_guard:
            self.finish_unguarded(canary, pin)
            return
        self.state = f"judging canary {canary.version} against {stable.version}"
        look = self.look(canary, stable, info)
        if look is None:
            return
        self.registry.update_metrics(canary.version, canary=look.info)
        if look.verdict == "continue":
            if self.gives_way(look.comparisons, look.canary_n) and not pin and (newer := self.newer_candidate(canary)):
                # Undecided is not worse: the newer candidate takes the canary's place, and
                # the learner's chain goes on (nothing was taken off users for its quality).
                self.promoter.transition(canary.version, "superseded", ACTOR,
                                         f"undecided after {look.canary_n} completions; {newer.version} is newer")
                self.take_candidate()
            else:
                self.stage_ahead(canary)
                if newer := self.newer_candidate(canary):  # its held-out figures ready for the verdict
                    self.ask_for_skill(newer)
            return
        self.conclude(canary, stable, look, pin)

    def finish_unguarded(self, canary: PolicyVersion, pin: Pin | None) -> None:
        """Without the live guard, the controller's canary goes to every replica at once,
        unless stable is pinned."""
        if pin:
            self.state = f"{canary.version} waits: stable pinned by {pin.actor}"
            return
        try:
            self.promoter.finish(canary.version, ACTOR, "every replica verified")
        except Exception as error:
            self.fail(canary.version, f"{type(error).__name__}: {error}")

    def look(self, canary: PolicyVersion, stable: PolicyVersion, info: dict) -> Look | None:
        """The guard's verdict on the canary from the figures since it started; None when
        it was taken off for want of production traffic to judge it on."""
        now = time.time()
        figures = self.figures([canary.version, stable.version], info["started_at"], now - self.judge_after_s)
        comparisons = self.compare(figures, stable.version, canary.version)
        tenants = self.compare_tenants(figures, stable.version, canary.version)
        age = now - info["started_at"]
        canary_n = max((c.canary_n for c in comparisons), default=0)
        verdict = "continue"
        if any(c.decision == "worse" for c in comparisons):
            verdict = "worse"
        elif comparisons and all(c.decision == "non_inferior" for c in comparisons):
            verdict = "non_inferior"
        elif age > self.config.max_canary_s or canary_n >= self.config.max_samples:
            verdict = "inconclusive"
        if self.quiet is not None and verdict == "continue" and self.quiet.quiet(
                canary.version, self.production_requests_per_s(), now):
            # Nobody to judge it: production's second replica is worth more to rollouts now.
            self.promoter.abort(canary.version, ACTOR, f"no production traffic for {self.quiet.quiet_s:.0f} s "
                                f"to judge it; a newer candidate is judged when traffic returns",
                                state="superseded")
            return None
        served = self.serving_figures([stable.version, canary.version], info["started_at"], now)
        serving = self.serving_checks(served, stable.version, canary.version)
        if failing := [c for c in serving if c.decision == "worse"]:
            verdict = "worse"  # failing or slow answers: whatever the feedback says
            comparisons = comparisons + failing
        if verdict != "worse" and (worse_for := [c for c in tenants if c.decision == "worse"]):
            # Fine on average, clearly worse for someone with enough traffic to tell.
            verdict = "worse" if self.config.tenant_worse == "abort" else "held"
            comparisons = comparisons + worse_for
        info = dict(info, verdict=verdict, seconds=round(age, 1), comparisons=[c.model_dump() for c in comparisons],
                    tenants=[c.model_dump() for c in tenants], serving=[c.model_dump() for c in serving])
        return Look(verdict, comparisons, canary_n, age, info)

    def conclude(self, canary: PolicyVersion, stable: PolicyVersion, look: Look, pin: Pin | None) -> None:
        """Act on a verdict other than continue: hold for a human, promote, or abort."""
        figures_text = "; ".join(f"{c.metric} {c.canary_mean:.3f} vs {c.stable_mean:.3f} "
                                 f"(n {c.canary_n}/{c.stable_n}, difference in [{c.low:+.3f}, {c.high:+.3f}])"
                                 for c in look.comparisons)
        if look.verdict == "held":
            self.state = f"{canary.version} held in canary: {figures_text}; promote or abort it by hand"
            if (canary.metrics.get("canary") or {}).get("verdict") != "held":  # ask once
                self.registry.record_event(canary.version, "held", ACTOR, f"held in canary for a human: {figures_text}")
                self.alert("canary_held", canary.version, figures_text, comparisons=look.info["comparisons"])
            return
        log(logger, "canary verdict", version=canary.version, verdict=look.verdict, seconds=round(look.age, 1),
            **{c.metric: f"{c.canary_mean:.3f} vs {c.stable_mean:.3f} [{c.low:+.3f}, {c.high:+.3f}]"
               for c in look.comparisons})
        if look.verdict == "non_inferior" and pin:
            self.state = f"{canary.version} non-inferior; stable pinned by {pin.actor}, so it waits"
            return
        if look.verdict == "non_inferior":
            successor = self.newer_candidate(canary)
            self.promoter.finish(canary.version, ACTOR, f"canary non-inferior to {stable.version}: {figures_text}",
                                 leave_one=successor is not None)
            if successor is not None:  # the replica left on the old stable takes it, one swap
                self.take_candidate()
                self.serve_stable_everywhere()  # unless it did not start
            return
        why = "clearly worse than" if look.verdict == "worse" else "not shown non-inferior to"
        reason = f"canary {why} {stable.version} after {look.age:.0f} s: {figures_text}"
        self.promoter.abort(canary.version, ACTOR, reason)
        # Worse: taken off users automatically. Inconclusive: a human should look; with
        # nobody to ask, stable stays.
        self.alert("canary_aborted" if look.verdict == "worse" else "canary_needs_a_human", canary.version, reason,
                   comparisons=look.info["comparisons"], seconds=look.info["seconds"])

    def gives_way(self, comparisons: list[Comparison], canary_n: int) -> bool:
        """Whether an undecided canary should give its replica to a newer candidate: after
        `canary_refresh_samples` completions, or sooner (from `min_samples` on) when at the
        rate its intervals narrow it would still have no verdict by then. One heading for
        "worse" is waited for: an abort rewinds the learner, giving way does not."""
        refresh = self.config.canary_refresh_samples
        return canary_n >= refresh or (canary_n >= self.config.min_samples and bool(comparisons)
                                       and not verdict_in_sight(comparisons, refresh))

    def stage_ahead(self, canary: PolicyVersion) -> None:
        """While the canary is judged, rebuild on the replicas beside it what they will
        serve after the verdict (the newest candidate that passed the gate on the first,
        which `finish` leaves for it; the canary's version on the others), so the swaps
        then only load. Staged already: nothing to do; failed: the swap stages again."""
        if self.settings.sync.transport != "delta":
            return
        beside = [r for r in read_pool(self.settings).general
                  if r.alias is None and r.policy_version != canary.version]
        successor = self.newer_candidate(canary)
        if self.staged[0] != canary.version:
            self.staged = (canary.version, set())
        for i, replica in enumerate(beside):
            version = successor.version if successor is not None and i == 0 else canary.version
            if (replica.name, version) in self.staged[1]:
                continue
            try:
                ReplicaSync.of(self.settings, replica.name).stage(version)
                self.staged[1].add((replica.name, version))
            except Exception as error:
                log(logger, "could not stage ahead", replica=replica.name, version=version, error=repr(error))

    def serve_stable_everywhere(self) -> None:
        """With no canary, every production replica serves stable: catches a replica left
        for a next canary that did not start (or by a controller killed in between). Not
        while another promotion or rollback is under way (it would undo its first pass)."""
        with promotion_lock(self.settings, wait=False) as held:
            stable = self.registry.stable()
            if not held or stable is None or self.registry.in_state("canary"):
                return
            if any(r.alias is None and r.policy_version != stable.version for r in read_pool(self.settings).general):
                if failed := [r for r in self.promoter.serve_everywhere(stable.version) if not r.ok]:
                    log(logger, "could not put stable on every replica", version=stable.version,
                        error=failed[0].error)

    def newer_candidate(self, canary: PolicyVersion) -> PolicyVersion | None:
        """The newest candidate after `canary` that passed the offline gate, if any."""
        newer = [c for c in self.registry.in_state("candidate")
                 if c.seq > canary.seq and (c.metrics.get("gate") or {}).get("passed")]
        return newer[-1] if newer else None

    def compare(self, figures: Figures, stable: str, canary: str) -> list[Comparison]:
        """Accept rate where there are accept-like verdicts, and mean reward. An abort needs
        one metric worse, so its level is split between them (Bonferroni) and the guard's
        false-abort rate stays its own; promotion needs every metric non-inferior, so each
        is tested at the whole promotion level (an intersection-union test needs no split)."""
        c = self.config
        metrics = [("reward", figures.reward, c.reward_margin)]
        if figures.accept.get(stable, Arm()).n or figures.accept.get(canary, Arm()).n:
            metrics.insert(0, ("accept_rate", figures.accept, c.margin))
        return [compare(name, arms.get(stable, Arm()), arms.get(canary, Arm()), alpha=c.false_abort_rate / len(metrics),
                        promotion_alpha=c.false_promotion_rate, tau=c.mixture_sd, margin=margin,
                        min_samples=c.min_samples)
                for name, arms, margin in metrics]

    def compare_tenants(self, figures: Figures, stable: str, canary: str) -> list[Comparison]:
        """Each tenant with `tenant_min_samples` judged completions on both arms, on its
        own accept rate; the level split across them, so more tenants do not mean more
        false aborts. With one such tenant the overall comparison already is its own."""
        c = self.config
        eligible = sorted(t for t, arms in figures.tenant_accept.items()
                          if min(arms.get(stable, Arm()).n, arms.get(canary, Arm()).n) >= c.tenant_min_samples)
        if len(eligible) < 2:
            return []
        return [compare(f"accept_rate[{tenant}]", figures.tenant_accept[tenant][stable],
                        figures.tenant_accept[tenant][canary], alpha=c.false_abort_rate / len(eligible),
                        promotion_alpha=c.false_promotion_rate, tau=c.mixture_sd, margin=c.margin,
                        min_samples=c.tenant_min_samples)
                for tenant in eligible]

    # --- the skill guard -----------------------------------------------------------------------
    def evaluator_answers(self) -> bool:
        """Whether the held-out evaluator runs: only then is there skill evidence to wait for.
        Where `liverl up` starts it (with the rollouts), it is waited for even while it does
        not answer: at its low priority on busy cores it may be slow to, and a candidate must
        not pass for want of an answer."""
        if not self.config.skill_guard or self.settings.rollouts.heldout_every_s is None:
            return False
        if self.settings.capacity.enabled:
            return True
        try:
            return self.http.get(self.settings.url(self.settings.ports.evaluator) + "/health", timeout=2).is_success
        except httpx.HTTPError:
            return False

    def ask_for_skill(self, candidate: PolicyVersion) -> None:
        """Ask the evaluator for the candidate's held-out figures (it scores those first)."""
        if "skill" not in candidate.metrics and self.evaluator_answers():
            self.registry.update_metrics(candidate.version, skill={"verdict": "waiting", "asked_at": time.time()})

    def ask_ahead(self, canary: PolicyVersion) -> None:
        """While a canary is judged, the newest candidate after it that passed the offline gate
        is scored: its verdict is ready when the canary ends, rather than a whole evaluation
        (tens of seconds at a peak on busy cores) after."""
        newer = [c for c in self.registry.in_state("candidate")
                 if c.seq > canary.seq and (c.metrics.get("gate") or {}).get("passed")]
        if newer:
            self.ask_for_skill(newer[-1])

    def skill_scored(self, eligible: list[PolicyVersion]) -> PolicyVersion | None:
        """While the evaluator runs: the newest candidate that passed the offline gate and has
        its held-out figures, while the newest of all is asked for (a learner that writes a
        version while one is scored would otherwise never leave one ready); None if none."""
        passed = [c for c in eligible if (c.metrics.get("gate") or {}).get("passed")]
        if not passed or not self.evaluator_answers():
            return None
        self.ask_for_skill(passed[-1])
        scored = [c for c in passed if "heldout" in c.metrics]
        return scored[-1] if scored else None

    def skill_references(self, stable: PolicyVersion, figures: dict) -> list[tuple[str, dict]] | None:
        """The versions a candidate must not have lost skill against, with their figures on
        the same tasks: the starter (the skill before any learning) and stable (what it
        replaces), or with `skill_reference` best_recent the best scored of the last
        `slide_lookback` stables, stable among them (the held-out watch's own reference: a
        skill users were served, lost a step at a time, no step significant against the
        stable before it, would otherwise drain away). None while stable is not scored yet
        (the evaluator scores it first)."""
        if "heldout" not in stable.metrics:
            return None

        def on_same_tasks(versions: list[PolicyVersion]) -> list[PolicyVersion]:
            return [v for v in versions if (v.metrics.get("heldout") or {}).get("task_set") == figures["task_set"]]

        recent = on_same_tasks([*self.scored_stables()[-self.config.slide_lookback:], stable]
                               if self.config.skill_reference == "best_recent" else [stable])
        best = [max(recent, key=lambda v: v.metrics["heldout"]["pass_rate"])] if recent else []
        references = {v.version: v.metrics["heldout"] for v in on_same_tasks([self.registry.versions()[0]]) + best}
        return list(references.items())

    def scored_stables(self) -> list[PolicyVersion]:
        """Each version that was stable and has held-out figures, in the order it first became stable."""
        versions = {version: self.registry.get(version) for version, _, _ in self.stable_periods()}
        return [v for v in versions.values() if "solved" in (v.metrics.get("heldout") or {})]

    def skill_passed(self, candidate: PolicyVersion, stable: PolicyVersion) -> bool:
        """The skill guard's verdict on the candidate before its canary: True to go on. Its
        figures are waited for while the evaluator runs (no evaluator: no evidence, no
        verdict); surely lost against a reference (`compare_skill`), it is held."""
        if not self.evaluator_answers():
            return True
        figures = candidate.metrics.get("heldout")
        asked = candidate.metrics.get("skill") or {}
        references = self.skill_references(stable, figures) if figures else None
        if figures is None or references is None:
            self.ask_for_skill(candidate)
            skill = self.registry.get(candidate.version).metrics.get("skill")
            if skill is not None and "blocked_at" not in skill:  # the canary waits from now (it may be asked ahead)
                self.registry.update_metrics(candidate.version, skill=skill | {"blocked_at": time.time()})
            self.state = f"{candidate.version} waits for its held-out evaluation (the skill guard)"
            return False
        comparisons = [compare_skill(figures.get("evaluation", "held-out"), version, reference["solved"],
                                     figures["solved"], margin=self.config.skill_margin,
                                     level=self.config.skill_false_hold_rate)
                       for version, reference in references]
        lost = [c for c in comparisons if c.lost_skill]
        self.registry.update_metrics(candidate.version, skill={
            "verdict": "held" if lost else "non_inferior", "comparisons": [c.model_dump() for c in comparisons],
            "waited_s": round(time.time() - asked.get("blocked_at", time.time()), 2)})
        if lost:
            self.hold_for_skill(candidate, stable, lost)
        return not lost

    def hold_for_skill(self, candidate: PolicyVersion, stable: PolicyVersion, lost: list[SkillComparison]) -> None:
        """A candidate that lost skill never reaches users: rejected with the figures, on-call
        told, and the learner rewinds (`skill_rewind_target`)."""
        reason = "held for skill: " + "; ".join(f"{c.text()}: more than {c.margin} below" for c in lost)
        log(logger, "candidate held for skill", version=candidate.version, reason=reason)
        # The rewind first: killed between the two, the candidate is judged again, never lost.
        target = self.skill_rewind_target(candidate, stable)
        self.registry.request_rewind(target.version, ACTOR, f"{candidate.version} {reason}")
        self.promoter.transition(candidate.version, "rejected", ACTOR, reason)
        self.alert("candidate_held_for_skill", candidate.version, reason, comparisons=[c.model_dump() for c in lost])
        self.state = f"{candidate.version} {reason}"

    def skill_rewind_target(self, held: PolicyVersion, stable: PolicyVersion) -> PolicyVersion:
        """Where the learner goes back to after `held` lost skill: with `skill_rewind` last_passed,
        its nearest ancestor since stable that passed the skill guard and still has its weights
        (a line search backs up to the last point that met the constraint, not to its start:
        in a day of Nov 30, three canaries that had passed gave way undecided or stood down, their
        children were held, and each hold sent the learner back to stable, so what those canaries
        had learned of production was trained again and lost again); else stable. Not the
        default: such an ancestor sits nearer the margin than stable, and five days with it were
        not told apart from four without in the same sitting (docs/learning.md)."""
        if self.config.skill_rewind == "stable":
            return stable
        return next((a for a in self.registry.ancestors(held.version, stable.version)
                     if (a.metrics.get("skill") or {}).get("verdict") == "non_inferior"
                     and a.state in ("candidate", "superseded") and Path(a.model_dir).exists()), stable)

    def continues_held(self, version: str) -> str | None:
        """The version held for skill that `version` was trained on top of, or None."""
        stable = self.registry.stable()
        return next((a.version for a in self.registry.ancestors(version, stable.version if stable else None)
                     if (a.metrics.get("skill") or {}).get("verdict") == "held"), None)

    # --- the slide guard -----------------------------------------------------------------------
    def stable_periods(self) -> list[tuple[str, float, float]]:
        """(version, from, to) for each time a version was stable, oldest first."""
        periods: list[tuple[str, float, float]] = []
        open_: dict[str, float] = {}
        for event in self.registry.history():
            if event["to"] == "stable":
                open_[event["version"]] = event["at"]
            elif event["from"] == "stable" and event["version"] in open_:
                periods.append((event["version"], open_.pop(event["version"]), event["at"]))
        periods += [(v, t, time.time()) for v, t in open_.items()]
        return sorted(periods, key=lambda p: p[1])

    def guard_slide(self) -> None:
        stable = self.registry.stable()
        periods = self.stable_periods()
        if stable is None or not periods or periods[-1][0] != stable.version:
            return
        judged_until = time.time() - self.judge_after_s
        current = self.figures([stable.version], periods[-1][1], judged_until).accept.get(stable.version, Arm())
        if current.n < self.config.slide_min_samples:
            return
        best: tuple[str, Arm] | None = None
        for version, since, until in periods[-1 - self.config.slide_lookback:-1]:
            if version == stable.version or not Path(self.registry.get(version).model_dir).exists():
                continue
            arm = self.figures([version], since, min(until, judged_until)).accept.get(version, Arm())
            if arm.n >= self.config.slide_min_samples and (best is None or arm.mean > best[1].mean):
                best = (version, arm)
        if best is None:
            return
        _, low, high = confidence_sequence(best[1], current, self.config.false_abort_rate, self.config.mixture_sd)
        if high >= -self.config.slide_margin:
            return
        reason = (f"slide: {stable.version} accepted {current.mean:.3f} (n {current.n}) against "
                  f"{best[0]}'s {best[1].mean:.3f} (n {best[1].n}); difference in [{low:+.3f}, {high:+.3f}], "
                  f"surely more than {self.config.slide_margin} below")
        log(logger, "rolling back a slide", version=stable.version, to=best[0], reason=reason)
        self.state = f"rolling back {stable.version} to {best[0]}"
        self.promoter.rollback(ACTOR, reason, to=best[0])
        self.alert("stable_rolled_back", stable.version, reason, restored=best[0])

    def watch_heldout(self) -> None:
        """The held-out pass rate of the latest stable the evaluator scored against the best
        of the `slide_lookback` scored before it, task by task, once each. A version can
        please production's users and still have lost a skill rollouts taught (the demo's
        day does: coding falls from 16% to 0-4%), and the canary guard, which compares
        production traffic, cannot see it. It alerts, and does not roll back: which of the
        two matters more is on-call's call. The latest scored stable may have been replaced
        while it was scored (an evaluation takes seconds, a canary too): it is still what
        users got."""
        if time.time() < self.next_heldout_check:
            return
        self.next_heldout_check = time.time() + 10 * self.config.poll_s
        scored = {v.version: v.metrics["heldout"] for v in self.scored_stables()}
        if not scored or list(scored)[-1] == self.heldout_checked:
            return
        *before, (version, figures) = scored.items()
        self.heldout_checked = version
        same_tasks = [(v, f) for v, f in before if f.get("task_set") == figures["task_set"]]
        same_tasks = same_tasks[-self.config.slide_lookback:]
        if not same_tasks:
            return
        best, best_figures = max(same_tasks, key=lambda vf: vf[1]["pass_rate"])
        # The best of several: Bonferroni.
        c = compare_skill(figures.get("evaluation", "held-out"), best, best_figures["solved"], figures["solved"],
                          margin=self.config.heldout_margin, level=self.config.false_abort_rate / len(same_tasks))
        # A restarted controller looks at the latest again: recorded already, it is the same spell.
        recorded = any(e["to"] == HELDOUT_REGRESSION for e in self.registry.history(version))
        if c.lost_skill and not recorded:
            reason = f"{c.text()}: more than {c.margin} below"
            self.registry.record_event(version, HELDOUT_REGRESSION, ACTOR, reason)
            if not self.heldout_regressed:
                self.alert(HELDOUT_REGRESSION, version, reason, best=best, lost=c.lost, gained=c.gained)
        self.heldout_regressed = c.lost_skill or recorded

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                with self.lock:
                    self.step()
            except Exception as error:  # the controller survives any one look, and says why
                self.last_error = f"{type(error).__name__}: {error}"[:500]
                log(logger, "controller step failed", error=self.last_error)
            stop.wait(self.config.poll_s)
