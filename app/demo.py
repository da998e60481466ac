"""`liverl demo`: a simulated product teaches the served policy a hidden preference.

Simulated users send code prompts through the gateway with the official `openai`
client and accept or reject each completion by a rule the policy never sees: the
completion must parse as Python and stay short. Only accept/reject reaches liverl,
through the ingest API. Meanwhile the learner trains candidates, the offline gate
checks them, and passing ones are rolled out; the table shows the accept rate of
each version as it serves.

With `--load day` the product has a day, compressed into minutes: traffic follows a curve
with troughs and peaks, idle replicas are lent to rollouts on the coding environment in
the troughs and taken back as the peaks return, and the summary adds the take-back
times, production latency while a replica was lent and while none was, and the
held-out pass rate of the coding environment per version.
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import random
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from liverl_client import FeedbackClient
from openai import OpenAI
from rich.console import Console
from rich.live import Live
from rich.table import Table

from app.tables import print_rows
from liverl.contracts import CapacityEvent
from liverl.keys import admin_headers
from liverl.settings import Settings, settings_with_defaults
from policies.registry import HELDOUT_REGRESSION, Registry
from promotion.sequential import compare_skill, wilson

VERSION_SQL = """SELECT policy_version, sum(samples) AS n,
    round(sum(reward_sum) / n, 3) AS mean_reward,
    round(sum(accepted) / nullIf(sum(judged), 0), 3) AS accept_rate
FROM version_hourly WHERE source != 'rollout' GROUP BY policy_version
ORDER BY toUInt32(substring(policy_version, 2))"""

PROMPT_STARTS = [
    "def {name}({args}):\n", "# {doc}\n", "import {module}\n", "class {cls}:\n",
    "for {var} in range({n}):\n", "if {var} > {n}:\n", "{var} = [",
]
FILL = dict(
    name=["add", "parse", "load", "merge", "count", "split_words", "mean"],
    args=["a, b", "path", "items", "text, sep", "x", "data, key"],
    doc=["sort a list", "read a file", "count words", "retry on error", "parse json"],
    module=["os", "sys", "json", "re", "math", "itertools"],
    cls=["Stack", "Queue", "Parser", "Config", "Cache"],
    var=["i", "x", "item", "line", "n"],
    n=["3", "10", "len(items)", "100"],
)


def make_prompt(rng: random.Random) -> str:
    template = rng.choice(PROMPT_STARTS)
    return template.format(**{k: rng.choice(v) for k, v in FILL.items()})


def hidden_rule(prompt: str, completion: str, max_lines: int = 4) -> bool:
    """The users' secret taste: prompt + completion is valid Python, and short."""
    lines = [line for line in completion.splitlines() if line.strip()]
    if not lines or len(lines) > max_lines:
        return False
    with warnings.catch_warnings():  # the policy's odd literals are not our warnings
        warnings.simplefilter("ignore")
        try:
            ast.parse(prompt + completion)
        except (SyntaxError, ValueError):
            return False
    return True


class Request(NamedTuple):
    """One production request the simulated users sent (a list in requests.json)."""

    at: float  # seconds since the users started
    seconds: float  # until the answer, or the failure
    ok: bool  # answered
    completion_tokens: int  # what the policy answered with: its length sets how long a request takes
    replica: str = ""  # which answered (the gateway's x-liverl-replica)
    retries: int = 0  # the client's own retries: an answer after one hides a failure


@dataclass
class Tally:
    served: int = 0
    accepted: int = 0
    first_at: float = 0.0
    log: list[tuple[float, bool]] = field(default_factory=list)


def day_load(t: float, day_s: float) -> float:
    """The share of users active `t` seconds into a compressed day of `day_s` seconds: a
    trough of about 28% of the day around midnight, a rise to a peak with every user active
    around noon, and down again. Through the trough's evening half one user is still active
    (the night shift), after midnight nobody."""
    share = 1.6 * (0.5 - 0.5 * math.cos(2 * math.pi * t / day_s)) - 0.3
    evening = (t % day_s) >= day_s / 2
    return min(1.0, max(NIGHT_SHIFT if evening else 0.0, share))


NIGHT_SHIFT = 1e-3  # a share above zero: the first user is active
USER_MAX_TOKENS = 24  # what a demo user asks for in each request


class Population:
    """Users hitting the gateway concurrently; their verdicts go to the ingest API. With a
    `load` curve, user i is active only while i < users * load(seconds since start)."""

    def __init__(self, settings: Settings, api_key: str, users: int, seed: int, max_tokens: int,
                 load: Callable[[float], float] | None = None,
                 judge: Callable[[str, str], bool] = hidden_rule):
        self.settings = settings
        self.openai = OpenAI(base_url=settings.url(settings.ports.gateway) + "/v1", api_key=api_key,
                             max_retries=5)
        self.feedback = FeedbackClient(settings.url(settings.ports.api), api_key, flush_interval_s=0.2)
        self.users = users
        self.seed = seed
        self.max_tokens = max_tokens
        self.tallies: dict[str, Tally] = {}
        self.load = load
        self.judge = judge  # (prompt, completion) -> accepted
        self.requests: list[Request] = []
        self.started = time.time()
        self.errors = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def active(self) -> int:
        """Users active now."""
        return self.users if self.load is None else math.ceil(self.users * self.load(time.time() - self.started))

    def user(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while not self._stop.is_set():
            if index >= self.active():
                time.sleep(0.2)
                continue
            prompt = make_prompt(rng)
            sent = time.time()
            try:
                raw = self.openai.completions.with_raw_response.create(
                    model="liverl", prompt=prompt, max_tokens=self.max_tokens, temperature=1.0,
                    seed=rng.randrange(2**31))
            except Exception:
                with self._lock:
                    self.errors += 1
                    self.requests.append(Request(sent - self.started, time.time() - sent, False, 0))
                time.sleep(0.5)
                continue
            answered_in = time.time() - sent
            completion = raw.parse()
            with self._lock:
                self.requests.append(Request(sent - self.started, answered_in, True,
                                             completion.usage.completion_tokens if completion.usage else 0,
                                             raw.headers.get("x-liverl-replica", ""), raw.retries_taken))
            version = raw.headers["x-liverl-policy-version"]
            ok = self.judge(prompt, completion.choices[0].text)
            extra = completion.model_extra
            assert extra is not None, "openai's models keep the gateway's extra fields (completion_id)"
            (self.feedback.accept if ok else self.feedback.reject)(extra["completion_id"])
            with self._lock:
                tally = self.tallies.setdefault(version, Tally(first_at=time.time() - self.started))
                tally.served += 1
                tally.accepted += ok
                tally.log.append((time.time() - self.started, ok))

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.user, args=(i,), daemon=True) for i in range(self.users)]
        for t in threads:
            t.start()
        return threads

    def stop(self, threads: list[threading.Thread]) -> None:
        self._stop.set()
        for t in threads:
            t.join()
        self.feedback.close()


def live_table(pop: Population, status: dict[str, dict]) -> Table:
    elapsed = time.time() - pop.started
    learner = status["learner"]
    title = (f"liverl demo - {elapsed:5.0f} s - learner at {learner.get('version', '?')}, "
             f"{learner.get('pending', 0)} samples pending - {pop.errors} errors\n"
             f"controller: {status['controller'].get('state', '?')}")
    if "capacity" in status:
        title += (f"\nload: {pop.active()} of {pop.users} users - lent to rollouts: "
                  f"{', '.join(status['capacity'].get('lent', [])) or 'none'} - rollout groups: "
                  f"{status['rollouts'].get('groups', 0)} ({status['rollouts'].get('cut', 0)} cut)")
    if heldout := status.get("evaluator", {}).get("heldout"):
        title += "\nheld-out pass rate, newest versions as the evaluator reaches them: " + ", ".join(
            f"{version} {rate:.0%}" for version, rate in list(heldout.items())[-6:])
    table = Table(title=title)
    for column in ("version", "first served (s)", "served", "accepted", "accept rate", "95% CI"):
        table.add_column(column, justify="right")
    with pop._lock:
        for version, t in sorted(pop.tallies.items(), key=lambda kv: int(kv[0][1:])):
            lo, hi = wilson(t.accepted, t.served)
            table.add_row(version, f"{t.first_at:.0f}", str(t.served), str(t.accepted),
                          f"{t.accepted / max(t.served, 1):.1%}", f"[{lo:.1%}, {hi:.1%}]")
    return table


def learning_curve(tallies: dict[str, Tally], window: int = 100) -> list[tuple[float, int, float]]:
    """(seconds, feedback events so far, accept rate of the last `window` verdicts)."""
    verdicts = sorted(e for t in tallies.values() for e in t.log)
    curve, accepted = [], 0
    for i, (at, ok) in enumerate(verdicts):
        accepted += ok - (verdicts[i - window][1] if i >= window else 0)
        if i + 1 >= window // 4:  # a rate of the first few verdicts is noise
            curve.append((at, i + 1, accepted / min(i + 1, window)))
    return curve


def plot(tallies: dict[str, Tally], out_dir: Path, day: dict | None = None) -> tuple[Path, Path]:
    """The learning curve against wall time (with each version's rate and 95% CI) and
    against feedback events; with a simulated day, a third panel: production load, the
    periods a replica was lent to rollouts (shaded) and the coding environment's held-out
    pass rate per version. A PNG, and an HTML page embedding it as SVG."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4 if day else 2, figsize=(25 if day else 13, 4.5))
    by_time, by_events = axes[:2]
    for _, t in sorted(tallies.items(), key=lambda kv: int(kv[0][1:])):
        if not t.log:
            continue
        times = [x for x, _ in t.log]
        lo, hi = wilson(t.accepted, t.served)
        by_time.hlines(t.accepted / t.served, min(times), max(times), color="tab:blue", linewidth=3)
        by_time.fill_between([min(times), max(times)], lo, hi, color="tab:blue", alpha=0.15)
    curve = learning_curve(tallies)
    by_time.plot([c[0] for c in curve], [c[2] for c in curve], color="tab:orange", linewidth=1,
                 label="last 100 verdicts")
    by_time.plot([], [], color="tab:blue", linewidth=3, label="each version (95% CI)")
    by_time.set_xlabel("seconds since the first request")
    by_time.set_title("Accept rate of the served policy")
    by_time.legend(loc="lower right", fontsize=8)
    by_events.plot([c[1] for c in curve], [c[2] for c in curve], color="tab:orange")
    by_events.set_xlabel("feedback events")
    by_events.set_title("Accept rate (last 100 verdicts) vs feedback")
    for ax in (by_time, by_events):
        ax.set_ylim(0, 1)
        ax.set_ylabel("accept rate")
        ax.grid(alpha=0.3)
    if day:
        day_panel(axes[2], day)
        skill_panel(axes[3], day)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    png, html = out_dir / "accept_rate.png", out_dir / "accept_rate.html"
    fig.savefig(png, dpi=120)
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    plt.close(fig)
    html.write_text(f"<!doctype html><title>liverl demo</title><h1>Accept rate per policy version</h1>"
                    f"{svg.getvalue()[svg.getvalue().index('<svg'):]}")
    return png, html


def day_panel(ax, day: dict) -> None:
    """Load against wall time, lent periods shaded, held-out pass rate per version."""
    ax.step([t for t, _ in day["load"]], [n for _, n in day["load"]], where="post", color="tab:gray",
            label="active users (production load)")
    for start, end, _ in day["lent"]:
        ax.axvspan(start, end, color="tab:green", alpha=0.15, linewidth=0)
    ax.axvspan(0, 0, color="tab:green", alpha=0.15, label="a replica lent to rollouts")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("active users")
    ax.set_title("Load, lending, and the coding environment")
    rates = ax.twinx()
    points = [(r["at_s"], r["pass_rate"]) for r in day["heldout"]]
    rates.plot([x for x, _ in points], [y for _, y in points], "o-", color="tab:purple",
               label="held-out pass rate per version")
    rates.set_ylim(0, 1)
    rates.set_ylabel("held-out pass rate (greedy)")
    handles = ax.get_legend_handles_labels()[0] + rates.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", fontsize=8)


def skill_panel(ax, day: dict) -> None:
    """Per stable version, in the order it became stable: production's accept rate and the
    held-out pass rate side by side; the candidates the skill guard held, as crosses at
    their held-out pass rate between the stables around them."""
    rows = day.get("stable_skill") or []
    x = range(len(rows))
    ax.plot(x, [r["accept_rate"] if r["accept_rate"] is not None else float("nan") for r in rows], "o-",
            color="tab:blue", label="production accept rate")
    ax.plot(x, [r["heldout_pass_rate"] if r["heldout_pass_rate"] is not None else float("nan") for r in rows],
            "s-", color="tab:purple", label="held-out pass rate")
    seqs = [int(r["version"][1:]) for r in rows]
    held = day.get("held_for_skill") or []
    ax.plot([sum(s < int(h["version"][1:]) for s in seqs) - 0.5 for h in held], [h["pass_rate"] for h in held],
            "x", color="tab:red", markersize=8, label=f"held for skill ({len(held)})")
    ax.set_xticks(list(x), [r["version"] for r in rows], rotation=90, fontsize=6)
    ax.set_ylim(0, 1)
    ax.set_title("Each stable version: production and held-out skill")
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8)


def lent_intervals(events: list[CapacityEvent], started: float, end_s: float) -> list[tuple[float, float, str]]:
    """(from, to, replica) in seconds since `started` for each period a replica was out of
    production for rollouts: from its lend to the take-back that succeeded."""
    intervals, open_at = [], {}
    for e in events:
        at = e.timestamp.timestamp() - started
        if e.action == "lend":
            open_at[e.replica] = at
        elif e.error is None and e.replica in open_at:
            intervals.append((open_at.pop(e.replica), at, e.replica))
    return intervals + [(at, end_s, replica) for replica, at in open_at.items()]


def take_back_seconds(events: list[CapacityEvent]) -> list[float]:
    """Per take-back that succeeded, seconds from the load reading that first asked for it
    (a failed attempt's, if its swap back failed first) to the replica serving production."""
    seconds: list[float] = []
    first_asked: dict[str, float] = {}
    for e in events:
        if e.action != "take_back":
            continue
        asked = first_asked.setdefault(e.replica, e.timestamp.timestamp() - e.seconds)
        if e.error is None:
            seconds.append(e.timestamp.timestamp() - asked)
            del first_asked[e.replica]
    return seconds


def p99(values: list[float]) -> float | None:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))] if values else None


def harvest(lent: list[tuple[float, float, str]], load: list[tuple[float, int]],
            tokens: list[tuple[float, int]]) -> dict:
    """Rollout tokens/s over all lent time (take-backs, lends, production beside it included),
    over the seconds a replica was lent with no production traffic at all (what a lent
    replica generates alone) and over those it was lent beside production, from
    per-second samples of the worker's token count."""
    users = dict(load)
    seconds = {"lent": 0.0, "alone": 0.0, "beside_production": 0.0}
    generated = dict.fromkeys(seconds, 0.0)
    for (t0, n0), (t1, n1) in itertools.pairwise(tokens):
        if not any(a <= t0 and t1 <= b for a, b, _ in lent):
            continue
        for period in ("lent", "alone" if users.get(t0, 1) == 0 else "beside_production"):
            seconds[period] += t1 - t0
            generated[period] += n1 - n0
    rates = {f"tokens_per_s_{period}": generated[period] / seconds[period] if seconds[period] else None
             for period in seconds}
    lent_rate, alone_rate = rates["tokens_per_s_lent"], rates["tokens_per_s_alone"]
    return rates | {"seconds_beside_production": seconds["beside_production"],
                    "share": lent_rate / alone_rate if lent_rate is not None and alone_rate else None}


def capacity_summary(pop: Population, events: list[CapacityEvent], rollouts: dict,
                     load: Sequence[tuple[float, int]] = (), tokens: Sequence[tuple[float, int]] = ()) -> dict:
    """What lending cost production and what it harvested: take-back times, failed
    requests, production latency p99 while a replica was lent and while none was, and
    rollout tokens/s while lent against a lent replica's alone (`harvest`).

    Latency also depends on what the policy answers, and lending changes the policy (it
    trains on rollouts), so peaks also report the mean completion length and the p99 of
    the requests answered at full length: the same work per request in both runs."""
    end_s = time.time() - pop.started
    lent = lent_intervals(events, pop.started, end_s)
    with pop._lock:
        requests = list(pop.requests)
    answered = [r for r in requests if r.ok]
    # Sent and answered while the replica that answered was lent: the router let production in.
    on_lent = [r for r in answered if any(name == r.replica and a <= r.at and r.at + r.seconds <= b
                                          for a, b, name in lent)]
    during = [r.seconds for r in answered if any(a <= r.at < b for a, b, _ in lent)]
    outside = [r for r in answered if not any(a <= r.at < b for a, b, _ in lent)]
    # Peaks: at least 3/4 of the users active, every replica back in production.
    peak = [r for r in outside if pop.load is not None and pop.load(r.at) >= 0.75]
    full_length = max((r.completion_tokens for r in answered), default=0)
    take_backs = take_back_seconds(events)
    return {"lends": sum(e.action == "lend" for e in events), "take_backs": len(take_backs),
            "take_back_s": {"median": statistics.median(take_backs) if take_backs else None,
                            "p99": p99(take_backs), "max": max(take_backs, default=None)},
            "take_backs_over_bound": sum(e.bound_s is not None and e.seconds > e.bound_s for e in events),
            "take_back_steps": [e.steps for e in events if e.action == "take_back"],
            "lent_seconds": sum(b - a for a, b, _ in lent),
            "production_requests": len(requests), "production_failed": sum(not r.ok for r in requests),
            "production_retried": sum(r.ok and r.retries > 0 for r in requests),
            "production_on_lent_replica": len(on_lent),
            "latency_p99_s": {"lent": p99(during), "not_lent": p99([r.seconds for r in outside]),
                              "peak": p99([r.seconds for r in peak]),
                              "peak_full_length": p99([r.seconds for r in peak if r.completion_tokens == full_length])},
            "peak_completion_tokens": statistics.mean(r.completion_tokens for r in peak) if peak else None,
            "rollout_groups": rollouts.get("groups", 0), "rollout_groups_cut": rollouts.get("cut", 0),
            "rollout_completions": rollouts.get("completions", 0),
            "harvest": harvest(lent, list(load), list(tokens)), "lent": lent}


def heldout_by_version(settings: Settings, started: float, tasks: int, most: int = 6,
                       until_s: float | None = None) -> list[dict]:
    """The coding environment's held-out pass rate (greedy, `tasks` tasks) per version, from
    the start (`at_s`: when each was written): the starter, every version the held-out
    evaluator scored on these same tasks while the stack ran (its figures as recorded, also
    where retention has since removed the weights), and up to `most` more whose weights
    retention kept (written within `until_s` seconds of `started`, if given), evenly
    spread, scored now."""
    from policies.starter import build_starter_policy
    from rollouts.coding import CodingEnvironment
    from rollouts.evaluate import greedy_pass_rate, task_set

    environment = CodingEnvironment(levels=settings.rollouts.levels)
    held = environment.heldout(tasks)
    versions, these_tasks = Registry(settings.policies_dir).versions(), task_set(held)
    recorded = {v.version: v.metrics["heldout"]["pass_rate"] for v in versions
                if (v.metrics.get("heldout") or {}).get("task_set") == these_tasks}
    later = [v for v in versions[1:] if until_s is None or v.created_at - started <= until_s]
    kept = [v for v in later if v.version not in recorded and Path(v.model_dir).is_dir()]
    if len(kept) > most:  # evenly spread, the newest included
        kept = [kept[round(i * (len(kept) - 1) / (most - 1))] for i in range(most)]
    chosen = recorded.keys() | {v.version for v in kept}

    def scored(version: str, model_dir: Callable[[], Path]) -> dict:
        if version in recorded:
            return {"pass_rate": recorded[version], "measured": "live"}
        return {"pass_rate": greedy_pass_rate(model_dir(), environment, held), "measured": "after"}

    def starter() -> Path:
        return Path(settings.starter.model_dir or build_starter_policy(
            settings.starter.cache_dir, seed=settings.starter.seed, progress=False))

    return [{"version": "v0", "at_s": 0.0, **scored("v0", starter)}] + [
        {"version": v.version, "at_s": max(0.0, v.created_at - started),
         **scored(v.version, partial(Path, v.model_dir))}
        for v in later if v.version in chosen]


def feedback_to_serving(settings: Settings) -> dict:
    """Seconds from feedback to every replica serving a version that learned from it.

    Per stable version: from the newest sample in its window (the fastest any feedback
    got in) and from the oldest (the slowest). Simulated users answer within
    milliseconds of being served, so serving time stands in for feedback time.
    """
    registry = Registry(settings.policies_dir)
    stable_at = {e["version"]: e["at"] for e in registry.history() if e["to"] == "stable"}
    newest, oldest = [], []
    for v in registry.versions():
        if v.version in stable_at and v.window and v.window.first_served:
            newest.append(stable_at[v.version] - v.window.last_served)
            oldest.append(stable_at[v.version] - v.window.first_served)
    if not newest:
        return {}
    return {"versions": len(newest), "median_newest": statistics.median(newest),
            "median_oldest": statistics.median(oldest), "max_oldest": max(oldest)}


def guard_verdicts(settings: Settings) -> list[dict]:
    """Versions the promotion controller took off users, and why (from the registry)."""
    registry = Registry(settings.policies_dir)
    stopped = []
    for event in registry.history():
        if event["to"] in ("aborted", "rolled_back") and event["actor"] == "controller":
            canary = registry.get(event["version"]).metrics.get("canary", {})
            stopped.append({"version": event["version"], "state": event["to"],
                            "seconds": canary.get("seconds"), "reason": event["reason"]})
    return stopped


def heldout_regressions(settings: Settings) -> list[dict]:
    """Stable versions the held-out watch found had surely lost held-out skill, and by how much."""
    return [{"version": event["version"], "reason": event["reason"]}
            for event in Registry(settings.policies_dir).history() if event["to"] == HELDOUT_REGRESSION]


def stable_skill(settings: Settings, per_version: list[dict], tasks: int) -> list[dict]:
    """Per version that was stable, in the order it became stable: when (seconds since the
    first stable), production's accept rate (ClickHouse's, what users judged) and the
    held-out pass rate the evaluator recorded on the day's `tasks` tasks, side by side;
    `below_starter` is the held-out watch's test against the starter (the exact sign test
    on the same tasks at `promotion.false_abort_rate`, by more than `heldout_margin`)."""
    from rollouts.coding import CodingEnvironment
    from rollouts.evaluate import task_set

    these = task_set(CodingEnvironment(levels=settings.rollouts.levels).heldout(tasks))
    registry, config = Registry(settings.policies_dir), settings.promotion
    accept = {row["policy_version"]: row for row in per_version}
    became: dict[str, float] = {}
    for event in registry.history():
        if event["to"] == "stable":
            became.setdefault(event["version"], event["at"])
    first = min(became.values(), default=0.0)
    starter = (registry.versions()[0].metrics.get("heldout") or {}) if became else {}
    rows = []
    for version, at in sorted(became.items(), key=lambda kv: kv[1]):
        figures = registry.get(version).metrics.get("heldout") or {}
        scored = figures.get("task_set") == these
        below = scored and starter.get("task_set") == these and compare_skill(
            "coding", "v0", starter["solved"], figures["solved"], margin=config.heldout_margin,
            level=config.false_abort_rate).lost_skill
        rows.append({"version": version, "stable_at_s": round(at - first, 1),
                     "accept_rate": accept.get(version, {}).get("accept_rate"),
                     "served": int(accept.get(version, {}).get("n", 0)),
                     "heldout_pass_rate": figures["pass_rate"] if scored else None, "below_starter": below})
    return rows


def held_for_skill(settings: Settings) -> list[dict]:
    """Candidates the skill guard held before their canary, with its verdict."""
    registry = Registry(settings.policies_dir)
    held = [v for v in registry.versions() if (v.metrics.get("skill") or {}).get("verdict") == "held"]
    return [{"version": v.version, "pass_rate": v.metrics["heldout"]["pass_rate"],
             "reason": next((e["reason"] for e in registry.history(v.version) if e["to"] == "rejected"), "")}
            for v in held]


def skill_guard_cost(settings: Settings) -> dict:
    """What judging skill before each canary cost: the evaluator's seconds per evaluation and
    the seconds each candidate's canary waited for its figures (medians and maxima; none if
    they were ready, asked for ahead during the canary before), and the verdicts."""
    versions = Registry(settings.policies_dir).versions()
    seconds = [v.metrics["heldout"]["seconds"] for v in versions if "seconds" in (v.metrics.get("heldout") or {})]
    judged = [v.metrics["skill"] for v in versions if "waited_s" in (v.metrics.get("skill") or {})]
    waited = [s["waited_s"] for s in judged]
    return {"evaluations": len(seconds), "evaluation_s": {"median": statistics.median(seconds) if seconds else None,
                                                           "max": max(seconds, default=None)},
            "judged": len(judged), "held": sum(s["verdict"] == "held" for s in judged),
            "waited_s": {"median": statistics.median(waited) if waited else None, "max": max(waited, default=None)}}


def stable_regressions(settings: Settings, per_version: list[dict], min_served: int = 200,
                       drop: float = 0.10) -> list[dict]:
    """Versions that reached stable serving clearly worse than the stable they replaced
    (`regressions`), in the order the registry made them stable."""
    order = [e["version"] for e in Registry(settings.policies_dir).history() if e["to"] == "stable"]
    return regressions(order, per_version, min_served, drop)


def regressions(order: list[str], per_version: list[dict], min_served: int = 200, drop: float = 0.10) -> list[dict]:
    """Of the versions in `order`, each replacing the one before it: those whose 95%
    Wilson upper bound on the accept rate (from ClickHouse's per-version figures, at
    least `min_served` completions) is more than `drop` below the replaced version's rate."""
    rates = {row["policy_version"]: (row["accept_rate"], int(row["n"])) for row in per_version
             if row["accept_rate"] is not None}
    worse = []
    for before, after in itertools.pairwise(order):
        if before not in rates or after not in rates or rates[after][1] < min_served:
            continue
        rate, n = rates[after]
        upper = wilson(round(rate * n), n)[1]
        if upper < rates[before][0] - drop:
            worse.append({"version": after, "accept_rate": rate, "upper": upper, "served": n,
                          "replaced": before, "replaced_rate": rates[before][0]})
    return worse


def summary(tallies: dict[str, Tally], recent_s: float = 120.0, rise: float = 0.40) -> dict:
    """What users saw: the starter's accept rate; the rate over the last `recent_s`
    seconds of the run, whichever versions served it (the best version's rate, also
    given, is the maximum over versions and so biased upward); and the seconds from
    the first request until the rate of the last 100 verdicts first stood `rise` above
    the starter's (None if it never did)."""
    versions = sorted(tallies, key=lambda v: int(v[1:]))
    first = tallies[versions[0]]
    starter_rate = first.accepted / max(first.served, 1)
    verdicts = sorted(e for t in tallies.values() for e in t.log)
    end = verdicts[-1][0] if verdicts else 0.0
    recent = [ok for at, ok in verdicts if at >= end - recent_s]
    judged = [v for v in versions if tallies[v].served >= 30] or versions
    best = max(judged, key=lambda v: tallies[v].accepted / max(tallies[v].served, 1))
    b = tallies[best]
    return {
        "starter": {"version": versions[0], "served": first.served,
                    "accept_rate": starter_rate, "ci": wilson(first.accepted, first.served)},
        "last_two_minutes": {"served": len(recent), "accept_rate": sum(recent) / max(len(recent), 1),
                             "ci": wilson(sum(recent), len(recent))},
        "time_to_plus_40_s": next((at for at, _, rate in learning_curve(tallies) if rate >= starter_rate + rise),
                                  None),
        "best": {"version": best, "served": b.served, "accept_rate": b.accepted / max(b.served, 1),
                 "ci": wilson(b.accepted, b.served), "first_served_s": b.first_at},
    }


def run_demo(settings: Settings, minutes: float, users: int, seed: int, max_tokens: int,
             out_dir: Path, console: Console, day_minutes: float | None = None, heldout: int = 50) -> dict:
    """The demo; with `day_minutes`, traffic follows a day of that length (`day_load`) and
    idle replicas are lent to rollouts (the settings must enable the capacity scheduler)."""
    from app.stack import up

    launched = time.time()
    if day_minutes is not None:  # the evaluator and the skill guard on the tasks the summary reports
        settings.rollouts.heldout_tasks = heldout
    console.print("[bold]starting the embedded stack[/bold]")
    up(settings, say=console.print)
    stopping = threading.Event()
    try:
        keys = json.loads(settings.dev_keys_file.read_text())
        load = None if day_minutes is None else (lambda t: day_load(t, day_minutes * 60))
        pop = Population(settings, keys["tenant_key"], users, seed, max_tokens, load)
        stopping = pop._stop
        threads = pop.start()
        status, active, tokens = watch(settings, pop, minutes, console, launched, day=day_minutes is not None)
        pop.stop(threads)
        result, day = results(settings, pop, status, active, tokens, out_dir)
    finally:
        stopping.set()  # a demo stopped early (Ctrl-C, `kill`): no user sends while the stack drains
        stop_stack(settings, console)
    if day is not None:  # with the stack down, so the evaluation has the cores
        console.print(f"held-out pass rate of the coding environment per version ({heldout} tasks, greedy)")
        day["heldout"] = heldout_by_version(settings, pop.started, heldout)
        print_rows(day["heldout"], "coding environment, held-out pass rate per version")
        result["day"] = {k: v for k, v in day.items() if k != "load"}
    png, html = plot(pop.tallies, out_dir, day)
    (out_dir / "summary.json").write_text(json.dumps(result, indent=2))
    console.print(f"plot: {png} and {html}")
    return result


def watch(settings: Settings, pop: Population, minutes: float, console: Console, launched: float,
          day: bool, every_s: float = 30.0) -> tuple[dict[str, dict], list[tuple[float, int]], list[tuple[float, int]]]:
    """Poll the components' health each second for `minutes` while the users run: a live table
    on a terminal, elsewhere a plain line every `every_s` seconds (`progress_line`); and one
    line when the first user request is served. Returns the last health of each, the users
    active and the rollout tokens over time."""
    import httpx

    components = ("learner", "controller") + (("capacity", "rollouts") if day else ())
    if day and settings.rollouts.heldout_every_s is not None:
        components += ("evaluator",)
    urls = {name: settings.url(getattr(settings.ports, name)) + "/health" for name in components}
    status: dict[str, dict] = {name: {} for name in urls}
    active: list[tuple[float, int]] = []  # (seconds, users active)
    tokens: list[tuple[float, int]] = []  # (seconds, rollout tokens so far)
    first_served, said = False, time.time()
    with Live(live_table(pop, status), console=console, refresh_per_second=2) as live:
        while time.time() - pop.started < minutes * 60:
            time.sleep(1)
            now = time.time() - pop.started
            active.append((now, pop.active()))
            for name, url in urls.items():
                try:
                    status[name] = httpx.get(url, timeout=2).json()
                except httpx.HTTPError:
                    pass
            if "rollouts" in status:
                tokens.append((now, status["rollouts"].get("tokens", 0)))
            if not first_served and pop.tallies:
                first_served = True
                version, tally = min(pop.tallies.items(), key=lambda kv: kv[1].first_at)
                console.print(f"first user request served by {version}, {time.time() - launched:.0f} s after "
                              f"`liverl demo` began ({tally.first_at:.1f} s after the users started)", soft_wrap=True)
            if not console.is_terminal and time.time() - said >= every_s:
                said = time.time()
                console.print(progress_line(pop, status, minutes), soft_wrap=True)
            live.update(live_table(pop, status))
    return status, active, tokens


def progress_line(pop: Population, status: dict[str, dict], minutes: float) -> str:
    """One plain line of the live table, for output that is not a terminal."""
    with pop._lock:
        versions = ", ".join(f"{v} {t.served} served {t.accepted / max(t.served, 1):.0%} accepted"
                             for v, t in sorted(pop.tallies.items(), key=lambda kv: int(kv[0][1:])))
    learner = status["learner"]
    return (f"demo {time.time() - pop.started:.0f} s of {minutes * 60:.0f}: {versions or 'nothing served yet'}; "
            f"learner at {learner.get('version', '?')}, {learner.get('pending', 0)} samples pending; "
            f"controller {status['controller'].get('state', '?')}; {pop.errors} errors")


def results(settings: Settings, pop: Population, status: dict[str, dict], active: list[tuple[float, int]],
            tokens: list[tuple[float, int]], out_dir: Path) -> tuple[dict, dict | None]:
    """With the users stopped: the day's capacity figures (with `rollouts` in `status`), a
    drain, ClickHouse's per-version table, and the summary; (result, day or None)."""
    import httpx

    from app.stack import drain, stop_sources

    # A trough at the end would feed the drain forever; the evaluator's figures are taken.
    stop_sources(settings, ("rollouts", "capacity", "evaluator"))
    day = None
    if "rollouts" in status:
        from liverl.lending import read_events

        day = capacity_summary(pop, read_events(settings), status["rollouts"], active, tokens)
        day["load"] = active
        day["heldout_live"] = status.get("evaluator", {}).get("heldout", {})  # as the evaluator reached them
        # Each production request (`Request`): runs of the same day compare window by window.
        out_dir.mkdir(parents=True, exist_ok=True)
        with pop._lock:
            (out_dir / "requests.json").write_text(json.dumps(pop.requests))
    drain(settings, settings.drain_timeout_s, say=lambda _: None)
    per_version = json.loads(httpx.post(settings.url(settings.ports.sink) + "/sql", timeout=60, json={
        "sql": VERSION_SQL, "format": "json"}, headers=admin_headers(settings)).raise_for_status().text)["data"]
    print_rows(per_version, "per policy version, from ClickHouse")
    result = summary(pop.tallies)
    result["feedback_to_serving_s"] = feedback_to_serving(settings)
    result["guard"] = guard_verdicts(settings)
    result["stable_regressions"] = stable_regressions(settings, per_version)
    if result["guard"]:
        print_rows(result["guard"], "versions the guard stopped")
    if day is not None:
        day["heldout_regressions"] = heldout_regressions(settings)
        if day["heldout_regressions"]:
            print_rows(day["heldout_regressions"], "stable versions that lost held-out skill (held-out watch)")
        day["stable_skill"] = stable_skill(settings, per_version, settings.rollouts.heldout_tasks)
        day["held_for_skill"] = held_for_skill(settings)
        day["skill_guard"] = skill_guard_cost(settings)
        print_rows(day["stable_skill"], "each stable version: production accept and held-out pass rate")
        if day["held_for_skill"]:
            print_rows(day["held_for_skill"], "candidates held for skill (the skill guard)")
    result["learning_curve"] = learning_curve(pop.tallies)[::25]
    result["clickhouse"] = per_version
    return result, day


def stop_stack(settings: Settings, console: Console) -> None:
    """Drain and stop the stack; without draining if the drain fails."""
    from app.stack import StackError, down

    console.print("[bold]draining and stopping[/bold]")
    try:
        down(settings, say=console.print)
    except StackError as error:
        console.print(f"[red]{error}[/red]; stopping without draining")
        down(settings, say=console.print, force=True)


# What the simulated day's learner does beyond the demo's (docs/learning.md, "Skills that hold").
DAY_LEARNER: dict[str, Any] = {
    # Rollouts come in the troughs only, and a day of production feedback alone trains the coding
    # skill away (22% -> 0%: issue 46): each version trains eight of the rollout groups trained
    # before again beside production's (learner/mix.py; docs/learning.md, "Training for both",
    # chose eight); the skill guard holds a candidate that lost the skill anyway.
    "replay_groups": 8,
    # Between troughs the skill was lost a little at each version of production alone (seed 4 of
    # Nov 29: 0.215 -> 0.125 over ten stables, no step significant): once users accept 80%, those
    # versions take half the step (learner/mix.py: settled_step).
    "settled_reward": 0.8, "settled_lr_scale": 0.5,
    # The first version moved 0.14-0.71 nats a token from the starter (target 0.04) in ten of ten
    # days of Nov 30, Adam's first updates each moving every weight by about the lr; in two of them
    # it lost half the skill and was held, and the starter served until 201-203 s. The first 20
    # updates (about four versions) warm up (learner/rl.py: warmup_share): v1 then moved 0.02-0.11
    # and none was held; the day's figures, five seeds each, were not told apart (0.875 and +2.5
    # points against 0.861 and +1.0: docs/benchmarks.md, "A warmup").
    "lr_warmup_updates": 20,
    # A version that lowers 16 passed rollout completions by over 0.02 nats a token trains again at
    # half the lr (learner/rl.py: backtracked): five days +17.0 held-out points and production 0.859
    # at the median, four without it -2.3 and 0.641 (docs/learning.md, "A line search on the skill
    # anchor").
    "max_skill_anchor_drop": 0.02,
    # Each version also trains 4 groups of training tasks the learner samples itself from its parent
    # (learner/own_groups.py): on-policy teaching between the troughs, not only in them. Five days
    # (Nov 30 night, AMD EPYC): the last stable +19.0 held-out points above the starter at the median
    # against -1.0 for five of the default without it that evening, production 0.902 (3 of 5 at 0.90)
    # against 0.938 (5 of 5): on two cores the sampling takes CPU that serving needs
    # (docs/learning.md, "The learner's own groups").
    "own_groups": 4,
    # On two cores the day's versions came every 23-29 s and most of each was the learner waiting for
    # a core: 9 s of CPU a version, 0.27 of a core over the day, as much as each of the ten other
    # components' sessions (Linux's autogroups share the CPU per session); with nothing else running a
    # version took 9-13 s. Five seeds (Dec 1, AMD EPYC): 25-27 versions instead of 16-22, production
    # 0.665 at the median against 0.547, the skill +5.5 points against +2.5, with 38% fewer production
    # requests served and p99 2.4 s at the peak against 1.6 (docs/learning.md, "The learner's
    # priority"). Below 0 needs CAP_SYS_NICE; without it the learner runs at everyone's priority.
    "nice": -5,
}


def demo_settings(day: bool = False) -> Settings:
    """The demo's stack: its own data directory, fast cadence, automatic promotion; for a
    simulated day, the capacity scheduler lends idle replicas to coding rollouts."""
    defaults: dict[str, Any] = {
        # PPO-clip around each version's parent: under the guard, stable serves about five
        # versions behind the learner and the canary two, and truncated-IS REINFORCE on such
        # stale samples overshoots and stalls at ~0.3 in 4 of 5 seeds; PPO's median is 0.91.
        # A baseline per kind of prompt frees the seeds PPO still stalls on (lowest of five
        # 0.86 instead of 0.70 at 80 rounds): benchmarks/bench_ablation.py; docs/history.md,
        # "The fast harness". A step sized by each version's KL from its parent takes +40 in
        # 9-10 versions instead of 11-12, where a fixed lr that large lets some seeds fall
        # back late ("An adaptive step size").
        # The learner at everyone's priority too (by default it trains in what the data plane
        # leaves): the demo's load is light, and its learning is what it shows.
        "learner": {"batch_samples": 96, "lr": 6e-4, "target_kl": 0.04, "lr_max": 7e-4, "max_version_lag": 3, "nice": 0,
                    "objective": "ppo", "baseline_by": "prompt_end", "gate_min_ess": 5.0, "gate_margin": 0.1},
        "feedback": {"reward_window_s": 300.0},
        # A canary serves beside stable on a second replica, half the sessions each; the
        # simulated users answer within milliseconds, so a completion is judged a second
        # after it was served.
        "serving": {"replicas": 2, "canary_share": 0.5},
        # Every process shares two cores: a niced stream let judged feedback reach the guard
        # 60-100 s late and halved the versions that served (docs/history.md); here the
        # stream and the sink keep up at the same priority as everyone else.
        "stream_nice": 0,
        # Latency is not judged here: both replicas, the learner and the users share two
        # cores, so a canary's p99 says which process the kernel ran, not how fast the
        # policy is (5 of the 7 aborts in the Nov 24-25 trials were p99-only, with accept
        # rates within a few points: docs/history.md).
        "promotion": {"auto_promote": True, "judge_after_s": 1.0, "margin": 0.1, "reward_margin": 0.1,
                      "canary_refresh_samples": 300, "latency_p99_ratio": None},
    }  # the demo's own defaults: `LIVERL_*` variables still override each of them
    if day:
        # Troughs last about a minute: lend after 10 s of no traffic at all, and the first
        # production request takes the replica back. On two shared cores a lent replica's
        # rollouts take the CPU production needs: one user beside them answered at 1.6-2.2x
        # its p99 alone (benchmarks/bench_harvest.py, Nov 27), so nothing is lent beside the
        # night shift's one user (replicas on devices of their own keep the defaults).
        defaults["capacity"] = {"enabled": True, "lend_after_s": 10.0, "lend_below": 0.0, "take_back_above": 0.0}
        # The lent replica follows the learner between its groups, so each version's groups are
        # sampled from its parent: five seeds of the day each (Nov 29, the same afternoon), the last
        # stable +8.5 held-out points above the starter at the median against -0.5 on the 30-s
        # timer, production 0.622 against 0.669 (docs/learning.md, "The lent replica between
        # groups"). With lend_below = take_back_above = 0 a replica behind the learner never idles.
        defaults["capacity"] |= {"refresh": "between_groups"}
        # A canary caught by a trough stands down rather than hold the second replica through it.
        defaults["promotion"] |= {"quiet_canary_s": 15.0}
        # The starter is small enough for the held-out evaluator to run it on a spare CPU thread.
        # Training tasks name their parameters from 176 identifiers, not twelve: with twelve of
        # one token an update favours those and stops after a name's first token.
        defaults["rollouts"] = {"environment": "coding", "levels": [1, 2], "group_size": 8, "max_tokens": 16,
                                "train_params": "wide", "heldout_every_s": 60.0}
        defaults["learner"] |= DAY_LEARNER
        # Each canary waits for the candidate's held-out figures (the skill guard), about a second
        # of CPU once the starter's lines are scored. Niced, the evaluator gets what the peaks leave:
        # at 19 the starter's took 158 s (Nov 28); at 5, on a machine slow for this stack, up to 101
        # and 247 s, and stable stayed the starter for 383 s and for the whole day. At everyone's
        # priority the same seeds' took at most 26-27 s, with 8 stables each and the same p99 (Nov 29
        # evening, four pairs: docs/benchmarks.md, "The evaluator at everyone's priority").
        defaults["rollouts"] |= {"heldout_nice": 0}
    return settings_with_defaults(defaults, data_dir=Settings().data_dir / "demo")
