"""The offline gate's error rates on simulated held-out logs (issue 46): how often a
candidate as good as its parent passes, and how often one `margin` worse does, at each
number of held-out samples, by the paired rule the learner runs (the lower bound of
candidate minus parent on the same samples, `policies/offline_eval.py: snis_difference`)
and by the rule before it (the candidate's own lower bound against the parent's value).

Each trial: n rewards of one with probability `pass_rate`, the parent the logging policy
(mean log-ratios of small noise), the candidate's weight moved off the passes so that its
true value is the parent's minus `gap`, plus noise of its own. The test
`tests/test_learner_math.py::test_the_offline_gate_is_calibrated_at_its_margin` asserts the
paired rule's two rates at 50 samples.

    .venv/bin/python benchmarks/bench_offline_gate.py
"""

from __future__ import annotations

import math

import torch
import typer
from rich.console import Console
from rich.table import Table

from policies.offline_eval import offline_check, snis, snis_difference


def passes(generator: torch.Generator, n: int, gap: float, pass_rate: float, margin: float) -> tuple[bool, bool]:
    """(paired rule, the rule before) on one simulated held-out set."""
    rewards = (torch.rand(n, generator=generator) < pass_rate).float()
    parent = 0.05 * torch.randn(n, generator=generator)
    moved = torch.where(rewards > 0, math.log((pass_rate - gap) / pass_rate),
                        math.log((1 - pass_rate + gap) / (1 - pass_rate)))
    candidate = parent + moved + 0.1 * torch.randn(n, generator=generator)
    mine, theirs = snis(candidate, rewards), snis(parent, rewards)
    paired = offline_check(mine, theirs, snis_difference(candidate, parent, rewards), margin, min_ess=5).passed
    return paired, mine.lower >= theirs.value - margin


def main(samples: list[int] = typer.Option([25, 50, 100, 200, 400], help="Held-out samples per trial."),
         trials: int = 2000, pass_rate: float = 0.3, margin: float = 0.1, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    table = Table(title=f"share of {trials} trials passed (pass rate {pass_rate}, margin {margin})")
    for column in ("held-out samples", "as good: paired", "as good: before", "margin worse: paired",
                   "margin worse: before"):
        table.add_column(column, justify="right")
    for n in samples:
        good = [passes(generator, n, 0.0, pass_rate, margin) for _ in range(trials)]
        worse = [passes(generator, n, margin, pass_rate, margin) for _ in range(trials)]
        table.add_row(str(n), *(f"{sum(r[i] for r in rows) / trials:.3f}" for rows in (good, worse) for i in (0, 1)))
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
