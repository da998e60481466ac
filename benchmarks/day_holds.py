"""Where the skill guard's holds fall in runs of the day (issue 46), read from each seed's
registry: for every rewind after a hold for skill, how many versions the held candidate was
trained after the stable of the moment, how far its own step moved it (KL from its parent),
whether an ancestor since stable had passed the skill guard, and where the learner was sent
(stable, or with `promotion.skill_rewind` last_passed that ancestor). Then, for runs whose
learner recorded the skill anchor's drop (`learner.max_skill_anchor_drop` or
`skill_anchor_coef` set), that drop for the candidates the guard held and those it passed, and
the versions the line search trained again. And for runs whose learner ran its own check
(`learner.skill_check_tasks`), each candidate the guard held: its share of the check tasks and
its held-out pass rate, each against the stable it was held against. Last, per seed: the
versions trained, those the line search trained again (and to its last try), the learner's
seconds a version at the median (its steps, its own groups, its offline gate, and from one version to
the next), and (`learner.own_groups`) the versions that trained the learner's
own groups and those groups' mean reward at the median.

    .venv/bin/python benchmarks/day_holds.py .liverl/bench-day-skill/ret200 .liverl/bench-day-skill/rewind
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from policies.registry import Registry


def stable_at(registry: Registry, at: float) -> str:
    """The version that was stable at time `at`."""
    made_stable = [e for e in registry.history() if e["to"] == "stable" and e["at"] <= at]
    return made_stable[-1]["version"]


def main(arms: list[Path] = typer.Argument(..., help="Each arm's --data-dir (seed-N/demo/policies under it).")) -> None:
    table = Table("arm", "holds", "versions after stable (holds)", "KL of the first-after-stable ones",
                  "with a passed ancestor", "sent to a passed ancestor")
    for arm in arms:
        depths: Counter[int] = Counter()
        first_kls: list[float] = []
        with_ancestor = sent_there = 0
        for policies in sorted(arm.glob("seed-*/demo/policies")):
            registry = Registry(policies)
            rows = registry.db.execute("SELECT version, at, reason FROM rewinds WHERE actor = 'controller'")
            for target, at, reason in rows.fetchall():
                if "held for skill" not in reason:
                    continue
                held, stable = reason.split()[0], stable_at(registry, at)
                ancestors = registry.ancestors(held, stable)
                depths[len(ancestors) + 1] += 1
                if not ancestors:
                    first_kls.append(registry.get(held).metrics.get("kl_from_parent") or 0.0)
                with_ancestor += any((a.metrics.get("skill") or {}).get("verdict") == "non_inferior" for a in ancestors)
                sent_there += target != stable
        kls = f"{min(first_kls):.3f}-{max(first_kls):.3f}" if first_kls else "-"
        table.add_row(arm.name, str(sum(depths.values())), ", ".join(f"{d}: {n}" for d, n in sorted(depths.items())),
                      kls, str(with_ancestor), str(sent_there))
    console = Console()
    console.print(table)
    anchor = Table("arm", "versions with an anchor", "backtracked", "anchor drop, held: median (range)",
                   "anchor drop, passed: median (range)")
    for arm in arms:
        versions = [v for policies in sorted(arm.glob("seed-*/demo/policies")) for v in Registry(policies).versions()
                    if "skill_anchor_drop" in v.metrics]
        if not versions:
            continue
        drops = {verdict: [v.metrics["skill_anchor_drop"] for v in versions
                           if (v.metrics.get("skill") or {}).get("verdict") == verdict]
                 for verdict in ("held", "non_inferior")}
        tries = [v.metrics.get("backtracks", 0) for v in versions]
        most = max(tries)
        anchor.add_row(arm.name, str(len(versions)), f"{sum(t > 0 for t in tries)} ({tries.count(most)} {most} times)",
                       spread(drops["held"]), spread(drops["non_inferior"]))
    if anchor.row_count:
        console.print(anchor)
    check_table(arms, console)
    pace_table(arms, console)


def check_table(arms: list[Path], console: Console) -> None:
    """The learner's check share and the held-out pass rate of each held candidate, against stable's."""
    table = Table("arm", "seed", "held", "against", "check share", "held-out pass rate")
    for arm in arms:
        for policies in sorted(arm.glob("seed-*/demo/policies")):
            registry = Registry(policies)
            for version in registry.versions():
                if "skill_check_pass_rate" not in version.metrics or version.metrics.get("skill", {}).get(
                        "verdict") != "held":
                    continue
                lost = [c for c in version.metrics["skill"]["comparisons"] if c["lost_skill"]]
                reference = registry.get(lost[0]["reference"])
                table.add_row(arm.name, policies.parent.parent.name, version.version, reference.version,
                              f"{version.metrics['skill_check_pass_rate']:.3f} against "
                              f"{reference.metrics.get('skill_check_pass_rate', float('nan')):.3f}",
                              f"{lost[0]['pass_rate']:.3f} against {lost[0]['reference_pass_rate']:.3f}")
    if table.row_count:
        console.print(table)


def pace_table(arms: list[Path], console: Console) -> None:
    """Per seed: versions trained, backtracked (to the last try), where a version's time went at the
    median (its training steps, the learner's own groups where recorded, the offline gate, and the
    seconds from one version to the next), own groups."""
    table = Table("arm", "seed", "versions", "backtracked (to the last try)", "seconds a version, median",
                  "own groups' seconds, median", "gate seconds, median", "between versions, median",
                  "with own groups", "own groups' reward, median")
    for arm in arms:
        for policies in sorted(arm.glob("seed-*/demo/policies")):
            versions = [v for v in Registry(policies).versions() if "train_seconds" in v.metrics]
            if not versions:
                continue
            trained = [v.metrics for v in versions]
            tries = [m.get("backtracks", 0) for m in trained]
            last_try = max(tries)
            own = [m["own_reward"] for m in trained if m.get("own_samples")]
            between = [b.created_at - a.created_at for a, b in itertools.pairwise(versions)]
            table.add_row(arm.name, policies.parent.parent.name, str(len(trained)),
                          f"{sum(t > 0 for t in tries)} ({tries.count(last_try) if last_try else 0} {last_try} times)",
                          median(m.get("train_seconds") for m in trained),
                          median(m.get("own_seconds") for m in trained if m.get("own_samples")),
                          median(m.get("gate_seconds") for m in trained), median(between), str(len(own)),
                          f"{statistics.median(own):.2f}" if own else "-")
    console.print(table)


def median(values) -> str:
    """The median of the values recorded (None: not recorded by that run's code), or '-'."""
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.1f}" if known else "-"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f}), n {len(values)}" if values else "-"


if __name__ == "__main__":
    typer.run(main)
