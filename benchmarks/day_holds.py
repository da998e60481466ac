"""Where the skill guard's holds fall in runs of the day (issue 46), read from each seed's
registry: for every rewind after a hold for skill, how many versions the held candidate was
trained after the stable of the moment, how far its own step moved it (KL from its parent),
whether an ancestor since stable had passed the skill guard, and where the learner was sent
(stable, or with `promotion.skill_rewind` last_passed that ancestor).

    .venv/bin/python benchmarks/day_holds.py .liverl/bench-day-skill/ret200 .liverl/bench-day-skill/rewind
"""

from __future__ import annotations

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
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
