"""`liverl demo`: a simulated product teaches the served policy a hidden preference.

Simulated users send code prompts through the gateway with the official `openai`
client and accept or reject each completion by a rule the policy never sees: the
completion must parse as Python and stay short. Only accept/reject reaches liverl,
through the ingest API. Meanwhile the learner trains candidates, the offline gate
checks them, and passing ones are rolled out; the table shows the accept rate of
each version as it serves.
"""

from __future__ import annotations

import ast
import json
import random
import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from openai import OpenAI
from rich.console import Console
from rich.live import Live
from rich.table import Table

from app.tables import print_rows
from liverl.client import FeedbackClient
from liverl.keys import admin_headers
from liverl.settings import Settings, settings_with_defaults
from policies.registry import Registry
from promotion.sequential import wilson

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
    lines = [l for l in completion.splitlines() if l.strip()]
    if not lines or len(lines) > max_lines:
        return False
    with warnings.catch_warnings():  # the policy's odd literals are not our warnings
        warnings.simplefilter("ignore")
        try:
            ast.parse(prompt + completion)
        except (SyntaxError, ValueError):
            return False
    return True


@dataclass
class Tally:
    served: int = 0
    accepted: int = 0
    first_at: float = 0.0
    log: list[tuple[float, bool]] = field(default_factory=list)


class Population:
    """Users hitting the gateway concurrently; their verdicts go to the ingest API."""

    def __init__(self, settings: Settings, api_key: str, users: int, seed: int, max_tokens: int):
        self.settings = settings
        self.openai = OpenAI(base_url=settings.url(settings.ports.gateway) + "/v1", api_key=api_key,
                             max_retries=5)
        self.feedback = FeedbackClient(settings.url(settings.ports.api), api_key, flush_interval_s=0.2)
        self.users = users
        self.seed = seed
        self.max_tokens = max_tokens
        self.tallies: dict[str, Tally] = {}
        self.started = time.time()
        self.errors = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def user(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while not self._stop.is_set():
            prompt = make_prompt(rng)
            try:
                raw = self.openai.completions.with_raw_response.create(
                    model="liverl", prompt=prompt, max_tokens=self.max_tokens, temperature=1.0,
                    seed=rng.randrange(2**31))
            except Exception:
                with self._lock:
                    self.errors += 1
                time.sleep(0.5)
                continue
            completion = raw.parse()
            version = raw.headers["x-liverl-policy-version"]
            ok = hidden_rule(prompt, completion.choices[0].text)
            (self.feedback.accept if ok else self.feedback.reject)(completion.model_extra["completion_id"])
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


def live_table(pop: Population, learner_status: dict, controller_status: dict) -> Table:
    elapsed = time.time() - pop.started
    table = Table(title=f"liverl demo - {elapsed:5.0f} s - learner at {learner_status.get('version', '?')}, "
                        f"{learner_status.get('pending', 0)} samples pending - {pop.errors} errors\n"
                        f"controller: {controller_status.get('state', '?')}")
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


def plot(tallies: dict[str, Tally], out_dir: Path) -> tuple[Path, Path]:
    """The learning curve against wall time (with each version's rate and 95% CI) and
    against feedback events: a PNG, and an HTML page embedding it as SVG."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_events) = plt.subplots(1, 2, figsize=(13, 4.5))
    for version, t in sorted(tallies.items(), key=lambda kv: int(kv[0][1:])):
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


def stable_regressions(settings: Settings, per_version: list[dict], min_served: int = 200,
                       drop: float = 0.10) -> list[dict]:
    """Versions that reached stable serving clearly worse than the stable they replaced:
    the 95% Wilson upper bound of their accept rate (from ClickHouse, at least
    `min_served` completions) more than `drop` below the replaced version's rate."""
    rates = {row["policy_version"]: (row["accept_rate"], int(row["n"])) for row in per_version
             if row["accept_rate"] is not None}
    order = [e["version"] for e in Registry(settings.policies_dir).history() if e["to"] == "stable"]
    worse = []
    for before, after in zip(order, order[1:]):
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
             out_dir: Path, console: Console) -> dict:
    import httpx

    from app.stack import StackError, down, drain, up

    console.print("[bold]starting the embedded stack[/bold]")
    up(settings, say=console.print)
    try:
        keys = json.loads(settings.dev_keys_file.read_text())
        pop = Population(settings, keys["tenant_key"], users, seed, max_tokens)
        threads = pop.start()
        urls = {name: settings.url(getattr(settings.ports, name)) + "/health" for name in ("learner", "controller")}
        status: dict[str, dict] = {name: {} for name in urls}
        with Live(live_table(pop, status["learner"], status["controller"]), console=console,
                  refresh_per_second=2) as live:
            while time.time() - pop.started < minutes * 60:
                time.sleep(1)
                for name, url in urls.items():
                    try:
                        status[name] = httpx.get(url, timeout=2).json()
                    except httpx.HTTPError:
                        pass
                live.update(live_table(pop, status["learner"], status["controller"]))
        pop.stop(threads)
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
        result["learning_curve"] = learning_curve(pop.tallies)[::25]
        result["clickhouse"] = per_version
        png, html = plot(pop.tallies, out_dir)
        (out_dir / "summary.json").write_text(json.dumps(result, indent=2))
        console.print(f"plot: {png} and {html}")
    finally:
        console.print("[bold]draining and stopping[/bold]")
        try:
            down(settings, say=console.print)
        except StackError as error:
            console.print(f"[red]{error}[/red]; stopping without draining")
            down(settings, say=console.print, force=True)
    return result


def demo_settings() -> Settings:
    """The demo's stack: its own data directory, fast cadence, automatic promotion."""
    defaults = {
        "learner": {"batch_samples": 96, "lr": 3e-4, "max_version_lag": 3,
                    "gate_min_ess": 5.0, "gate_margin": 0.1},
        "feedback": {"reward_window_s": 300.0},
        # A canary serves beside stable on a second replica, half the sessions each; the
        # simulated users answer within milliseconds, so a completion is judged a second
        # after it was served.
        "serving": {"replicas": 2, "canary_share": 0.5},
        # Every process shares two cores: a niced stream let judged feedback reach the guard
        # 60-100 s late and halved the versions that served (docs/learning.md); here the
        # stream and the sink keep up at the same priority as everyone else.
        "stream_nice": 0,
        # Latency is not judged here: both replicas, the learner and the users share two
        # cores, so a canary's p99 says which process the kernel ran, not how fast the
        # policy is (5 of the 7 aborts in the Nov 24-25 trials were p99-only, with accept
        # rates within a few points: docs/learning.md).
        "promotion": {"auto_promote": True, "judge_after_s": 1.0, "margin": 0.1, "reward_margin": 0.1,
                      "canary_refresh_samples": 300, "latency_p99_ratio": None},
    }  # the demo's own defaults: `LIVERL_*` variables still override each of them
    return settings_with_defaults(defaults, data_dir=Settings().data_dir / "demo")
