"""Learning from rollouts alone: production feedback off, a replica lent to coding rollouts
from the start, the learner training on nothing else. Does the held-out pass rate of the
coding environment rise, and by how much in the time given?

The demo's stack for a simulated day (`app/demo.py: demo_settings(day=True)`: two
replicas, the learner, the capacity scheduler, the rollout worker on the coding
environment's levels 1-2 with its wide pool of training names, groups of 8) with no users
at all: after `lend_after_s` the scheduler lends one replica (one stays in production,
`min_production_replicas`), which follows the learner's newest version every `refresh_s`.
With no production traffic no canary can be judged, so stable stays the starter; rollouts
sample the learner's head.
After the run, with the stack down, each of up to `--versions` versions whose weights
retention kept is evaluated greedily on `--heldout` held-out tasks (the starter too).
The issue's target: the newest version written within 10 minutes at least 25 points above
the starter, with non-overlapping 95% (Wilson) intervals.

    .venv/bin/python benchmarks/bench_rollout_learning.py --minutes 10 --out bench-rollouts/run
    .venv/bin/python benchmarks/bench_rollout_learning.py --set LIVERL_STARTER__MODEL_DIR=/path/to/hf-checkpoint
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
console = Console()

# Rollouts alone: lend at once, and keep the lent replica within a version or two of the
# learner's head (a version every ~4 s; samples more than max_version_lag behind are dropped).
# Every version's weights are kept (a few MB each), so the evaluation can spread over the run;
# the evaluation after the run measures, so no evaluator takes a core from the two meanwhile.
# What RL may change: only the attention's queries and keys. The copy the starter learned
# (the tied embeddings, the attention's values and outputs, the experts) stays as it is, so
# the update changes where the policy looks, not how a name it reads is written out. With
# the values and outputs free as well the held-out rate peaked and fell back; with the whole
# model (embeddings frozen), lower peaks. A fixed lr of 1.25e-4: since the sink writes in
# batches, versions come 60% faster, and 2e-4 (chosen before: 1e-4 rose slower, 3e-4 fell
# back) ended at +22.0 to +24.5, 1.25e-4 at +29.5 to +33.5 (docs/history.md, "Production
# first at the take-back"); #12's adaptive step from 6e-4 did not learn from rollouts.
# Groups whose rewards are all equal are dropped (nothing to learn; they would fill a
# version's batch). The demo's day trains on the wide pool of parameter names
# (`rollouts.train_params`), and the starter
# copies names of several tokens: each held-out task passes or fails by its name, and the
# twelve one-token training names could not teach `word` (two tokens) or names the starter
# confuses: +18.5 to +25.0 before, +35.5 with both (docs/history.md, "What the update may
# change", "Name by name", "A starter that copies names of several tokens").
ROLLOUTS_ONLY = {"LIVERL_CAPACITY__LEND_AFTER_S": "2", "LIVERL_CAPACITY__REFRESH_S": "5",
                 "LIVERL_LEARNER__LR": "1.25e-4", "LIVERL_LEARNER__TARGET_KL": "null",
                 "LIVERL_LEARNER__FROZEN_PARAMETERS": '["embed_tokens", "lm_head", "mlp", "norm", "v_proj", "o_proj"]',
                 "LIVERL_LEARNER__DROP_UNIFORM_GROUPS": "true", "LIVERL_ROLLOUTS__HELDOUT_EVERY_S": "null",
                 "LIVERL_SYNC__KEEP_VERSIONS": "100000", "LIVERL_DATA_DIR": str(ROOT / ".liverl/bench-rollouts")}


def progress_table(elapsed: float, status: dict[str, dict]) -> Table:
    learner, rollouts = status["learner"], status["rollouts"]
    table = Table(title=f"rollouts alone - {elapsed:5.0f} s")
    for column in ("learner at", "pending", "lent", "groups", "cut", "completions", "rollout tokens"):
        table.add_column(column, justify="right")
    table.add_row(str(learner.get("version", "?")), str(learner.get("pending", 0)),
                  ", ".join(status["capacity"].get("lent", [])) or "none", str(rollouts.get("groups", 0)),
                  str(rollouts.get("cut", 0)), str(rollouts.get("completions", 0)), str(rollouts.get("tokens", 0)))
    return table


def plot(points: list[dict], train_reward: list[dict], path: Path, minutes: float, uniform_dropped: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    at = [p["at_s"] for p in points]
    rate = [p["pass_rate"] for p in points]
    ax.errorbar(at, rate, yerr=[[r - p["ci"][0] for r, p in zip(rate, points, strict=True)],
                                [p["ci"][1] - r for r, p in zip(rate, points, strict=True)]], fmt="o-", capsize=3,
                label="held-out pass rate, greedy (95% CI)")
    reward = [r for r in train_reward if r["mean_reward"] is not None]
    ax.plot([r["at_s"] for r in reward], [r["mean_reward"] for r in reward], color="tab:gray",
            linewidth=1, label="mean reward of the groups each version trained on"
            + (" (groups all alike dropped)" if uniform_dropped else ""))
    for p in points:
        ax.annotate(p["version"], (p["at_s"], p["pass_rate"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(-10, minutes * 60 + 10)
    ax.set_ylim(0, 1)
    ax.set_xlabel("seconds since the stack was up (version created)")
    ax.set_ylabel("pass rate / reward")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Coding environment, learning from rollouts alone")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(minutes: float = typer.Option(10.0, help="How long rollouts run."),
         heldout: int = typer.Option(200, help="Held-out tasks per evaluated version (greedy)."),
         versions: int = typer.Option(6, help="Versions evaluated afterwards besides the starter, evenly "
                                      "spread, the newest included (versions the held-out evaluator scored on the "
                                      "same tasks join with its figures)."),
         out: Path = typer.Option(Path("bench-rollouts/run"), help="Where the result and the plot go."),
         set_: list[str] = typer.Option([], "--set", help="VAR=VALUE settings for the run.")) -> None:
    os.environ.update(ROLLOUTS_ONLY)
    os.environ.update(dict(item.split("=", 1) for item in set_))
    from app.demo import demo_settings, heldout_by_version
    from app.stack import down, drain, stop_sources, up, wipe_data_dir
    from policies.registry import Registry
    from promotion.sequential import wilson

    settings = demo_settings(day=True)
    wipe_data_dir(settings)  # every run from the starter
    out.mkdir(parents=True, exist_ok=True)
    up(settings, say=console.print)
    started = time.time()
    try:
        urls = {name: settings.url(getattr(settings.ports, name)) + "/health"
                for name in ("learner", "capacity", "rollouts")}
        status: dict[str, dict] = {name: {} for name in urls}
        with Live(progress_table(0, status), console=console, refresh_per_second=1) as live:
            while time.time() - started < minutes * 60:
                time.sleep(2)
                for name, url in urls.items():
                    try:
                        status[name] = httpx.get(url, timeout=2).json()
                    except httpx.HTTPError:
                        pass
                live.update(progress_table(time.time() - started, status))
        stop_sources(settings, ("rollouts", "capacity"))
        drain(settings, settings.drain_timeout_s, say=lambda _: None)
    finally:  # drained above when the run ended whole; on a failure, nothing is left running
        down(settings, say=console.print, force=True)
    console.print(f"evaluating up to {versions + 1} versions on {heldout} held-out tasks (greedy)")
    points = heldout_by_version(settings, started, heldout, most=versions, until_s=minutes * 60)
    for p in points:
        p["ci"] = wilson(round(p["pass_rate"] * heldout), heldout)
    table = Table(title=f"held-out pass rate ({heldout} tasks, levels {settings.rollouts.levels}, greedy)")
    for column in ("version", "created at (s)", "pass rate", "95% CI"):
        table.add_column(column, justify="right")
    for p in points:
        table.add_row(p["version"], f"{p['at_s']:.0f}", f"{p['pass_rate']:.1%}",
                      f"[{p['ci'][0]:.1%}, {p['ci'][1]:.1%}]")
    console.print(table)
    starter, last = points[0], points[-1]  # the newest written within the time given
    # Each version's mean reward on its own training groups: how fast the training split is learned.
    train_reward = [{"version": v.version, "at_s": v.created_at - started, "mean_reward": v.metrics.get("mean_reward")}
                    for v in Registry(settings.policies_dir).versions()[1:]]
    result = {"minutes": minutes, "heldout": heldout, "settings": set_, "points": points, "last": last["version"],
              "train_reward": train_reward,
              "rollouts": status["rollouts"], "learner_version": status["learner"].get("version"),
              "rise": last["pass_rate"] - starter["pass_rate"],
              "separated": last["ci"][0] > starter["ci"][1]}
    console.print(f"starter {starter['pass_rate']:.1%} -> {last['version']} {last['pass_rate']:.1%}: "
                  f"{100 * result['rise']:+.1f} points, intervals {'apart' if result['separated'] else 'overlap'} "
                  f"(target +25 points, apart)")
    (out / "result.json").write_text(json.dumps(result, indent=2))
    plot(points, train_reward, out / "heldout.png", minutes, settings.learner.drop_uniform_groups)


if __name__ == "__main__":
    typer.run(main)
