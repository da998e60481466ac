"""Skills that hold (issue 46): seeds of the simulated day, each checked for what users got
and for the coding skill the rollouts teach.

Runs `liverl demo --load day` once per seed, one after the other (each on a fresh embedded
stack in its own data directory, its ports moved by `--port-offset`), and reads each run's
summary.json: production accept over the last two minutes; per stable version its
production accept and held-out pass rate (`day.stable_skill`), whether any stable is
significantly below the starter on the held-out tasks (the held-out watch's own test:
the exact sign test on the same tasks at `promotion.false_abort_rate`, more than
`heldout_margin` below); the last stable's held-out pass rate against the starter's; the
candidates the skill guard held. From each run's registry: how long the starter stayed
stable, the canaries given up undecided, the versions trained and those that took a smaller
step. Prints each run, the median and the range, and writes a markdown report.

    .venv/bin/python benchmarks/bench_day_skill.py --seeds 0 --seeds 1 --seeds 2 --seeds 3 --seeds 4 \\
        --minutes 8 --day-minutes 4 --heldout 200 --out bench-day-skill/run
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from policies.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
console = Console()
PORTS = {"api": 18080, "gateway": 18000, "sink": 18090, "feedback": 18070, "learner": 18060, "controller": 18050,
         "capacity": 18040, "rollouts": 18030, "evaluator": 18020, "replica_base": 18100}


def run(seed: int, minutes: float, day_minutes: float, heldout: int, out: Path, env: dict[str, str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(out / "demo.log", "w") as log:
        subprocess.run([str(ROOT / ".venv/bin/liverl"), "demo", "--load", "day", "--minutes", str(minutes),
                        "--day-minutes", str(day_minutes), "--heldout", str(heldout), "--seed", str(seed),
                        "--out", str(out)], cwd=ROOT, env=dict(os.environ, **env), stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    result = json.loads((out / "summary.json").read_text())
    result["wall_s"] = time.time() - started
    return result


def registry_readings(registry: Registry) -> dict:
    """What the summary does not say: the times to the first version past the offline gate and
    to the first promotion (from the registry's first event), canaries given up undecided,
    versions trained, and those stepped at a smaller lr."""
    events, versions = registry.history(), registry.versions()
    promoted = [e["at"] for e in events if e["from"] == "canary" and e["to"] == "stable"]
    gated = [v.created_at for v in versions if (v.metrics.get("gate") or {}).get("passed")]
    return {"first_gate_pass_s": round(gated[0] - events[0]["at"]) if gated else None,
            "first_promotion_s": round(promoted[0] - events[0]["at"]) if promoted else None,
            "undecided": sum(e["to"] == "superseded" and (e["reason"] or "").startswith("undecided") for e in events),
            "versions": len(versions) - 1,
            "smaller_steps": sum((v.metrics.get("lr_scale") or 1) < 1 for v in versions)}


def row(seed: int, r: dict, registry: Registry) -> dict:
    day = r["day"]
    stables = day["stable_skill"]
    scored = [s for s in stables if s["heldout_pass_rate"] is not None]
    starter, last = scored[0]["heldout_pass_rate"], scored[-1]["heldout_pass_rate"]
    return {"seed": seed, "last_2_min": r["last_two_minutes"]["accept_rate"], "stables": len(stables),
            "stables_scored": len(scored), "below_starter": sum(s["below_starter"] for s in stables),
            "held_for_skill": len(day["held_for_skill"]), "starter_heldout": starter,
            "last_stable": scored[-1]["version"], "last_stable_heldout": last, "gain_points": 100 * (last - starter),
            "best_stable_heldout": max(s["heldout_pass_rate"] for s in scored),
            "guard_stopped": len(r.get("guard", [])), "evaluation_s_max": day["skill_guard"]["evaluation_s"]["max"],
            "p99_peak_s": day["latency_p99_s"]["peak"], **registry_readings(registry), "wall_s": r["wall_s"]}


def seconds(value: float | None, none: str = "none", digits: int = 0) -> str:
    return none if value is None else f"{value:.{digits}f} s"


def report(rows: list[dict], command: str) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines = [f"`{command}`", "", f"{time.strftime('%a %b %d %H:%M UTC %Y', time.gmtime())}; {cpu}, "
             f"{os.cpu_count()} CPUs", "",
             "| seed | last two minutes | stables (scored) | below the starter | held for skill | held-out: starter "
             "| last stable | best stable | points gained | first past the gate, first promotion "
             "| given up undecided | versions (smaller steps) | longest evaluation | p99 at the peak |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        first = f"{seconds(r['first_gate_pass_s'], 'never')}, {seconds(r['first_promotion_s'], 'never')}"
        lines.append(f"| {r['seed']} | {r['last_2_min']:.3f} | {r['stables']} ({r['stables_scored']}) | "
                     f"{r['below_starter']} | {r['held_for_skill']} | {r['starter_heldout']:.3f} | "
                     f"{r['last_stable']} {r['last_stable_heldout']:.3f} | {r['best_stable_heldout']:.3f} | "
                     f"{r['gain_points']:+.1f} | {first} | {r['undecided']} | {r['versions']} ({r['smaller_steps']}) | "
                     f"{seconds(r['evaluation_s_max'])} | {seconds(r['p99_peak_s'], digits=2)} |")
    last, gain = [r["last_2_min"] for r in rows], [r["gain_points"] for r in rows]
    lines += ["", f"Last two minutes: median {statistics.median(last):.3f} ({min(last):.3f}-{max(last):.3f}), "
              f"{sum(x >= 0.9 for x in last)} of {len(rows)} at 0.90 or more. Stables below the starter: "
              f"{sum(r['below_starter'] for r in rows)} in all runs. Last stable against the starter: median "
              f"{statistics.median(gain):+.1f} points ({min(gain):+.1f} to {max(gain):+.1f})."]
    return "\n".join(lines) + "\n"


def main(seeds: list[int] = typer.Option([0, 1, 2, 3, 4], help="One day per seed."),
         minutes: float = 8.0, day_minutes: float = 4.0, heldout: int = 200,
         port_offset: int = typer.Option(0, help="Added to every default port (as LIVERL_TEST_PORT_OFFSET)."),
         data_dir: Path = typer.Option(Path(".liverl/bench-day-skill"), help="Each run's stack lives under here."),
         out: Path = typer.Option(Path("bench-day-skill/run"), help="Where each run's output goes."),
         set_: list[str] = typer.Option([], "--set", help="VAR=VALUE settings for every run.")) -> None:
    env = dict(item.split("=", 1) for item in set_)
    env["LIVERL_PORTS"] = json.dumps({name: port + port_offset for name, port in PORTS.items()})
    env["LIVERL_BROKER"] = json.dumps({"kind": "embedded", "port": 19092 + port_offset})
    rows = []
    for seed in seeds:
        console.print(f"seed {seed}: liverl demo --load day --minutes {minutes} --day-minutes {day_minutes} "
                      f"--heldout {heldout}")
        seed_dir = data_dir.resolve() / f"seed-{seed}"
        try:
            result = run(seed, minutes, day_minutes, heldout, out / f"seed-{seed}",
                         dict(env, LIVERL_DATA_DIR=str(seed_dir)))
        except subprocess.CalledProcessError:  # a stack that did not start (say): told, and the next seed
            console.print(f"[red]seed {seed} failed[/red]: see {out / f'seed-{seed}' / 'demo.log'}")
            continue
        rows.append(row(seed, result, Registry(seed_dir / "demo" / "policies")))
        console.print(rows[-1])
        (out / "runs.json").write_text(json.dumps(rows, indent=2))
    table = Table(title=f"the day, {minutes} min, day of {day_minutes} min, {heldout} held-out tasks")
    for column in rows[0]:
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()))
    console.print(table)
    command = (".venv/bin/python benchmarks/bench_day_skill.py " + " ".join(f"--seeds {s}" for s in seeds)
               + f" --minutes {minutes:g} --day-minutes {day_minutes:g} --heldout {heldout}"
               + "".join(f" --set {s}" for s in set_))
    (out / "report.md").write_text(text := report(rows, command))
    console.print(text)


if __name__ == "__main__":
    typer.run(main)
