"""How hard the coding environment is for a policy: pass rates per level at temperature 1
and greedily on the held-out set, sampled with transformers (no stack needed).

    .venv/bin/python benchmarks/bench_coding_env.py                 # the starter policy
    .venv/bin/python benchmarks/bench_coding_env.py --model DIR     # any HF checkpoint
    .venv/bin/python benchmarks/bench_coding_env.py --model DIR --tasks-per-level 0 \
        --heldout-levels 1 --heldout-levels 2 --examples 20       # what a trained version answers held out

The issue's bar for the built-in environment: the starter passes at least 5% of the
easiest level at temperature 1 (GRPO gets signal at once) and at most 30% of 200
held-out tasks greedily (there is room to learn).
"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.progress import track
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from liverl.settings import StarterPolicyConfig
from liverl.task_pools import PARAMS
from policies.starter import build_starter_policy
from rollouts.coding import LEVELS, CodingEnvironment
from rollouts.evaluate import first_lines


def main(model: Path | None = typer.Option(None, help="HF checkpoint; default: the starter policy."),
         tasks_per_level: int = typer.Option(40, help="Tasks per level sampled at temperature 1."),
         samples: int = typer.Option(16, help="Samples per task at temperature 1 (a group)."),
         heldout: int = typer.Option(200, help="Held-out tasks, each sampled once greedily."),
         heldout_levels: list[int] = typer.Option([], help="Levels of the held-out set; default: all."),
         examples: int = typer.Option(0, help="Held-out tasks failed greedily to show with the answer."),
         max_tokens: int = typer.Option(16, help="Tokens per completion."),
         seed: int = typer.Option(0)) -> None:
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    model_dir = model or build_starter_policy(StarterPolicyConfig().cache_dir, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    env = CodingEnvironment()
    scoring = ThreadPoolExecutor(4)
    table = Table(title=f"coding environment, {model_dir}")
    for column in ("tasks", "sampling", "completions", "passed", "pass rate", "tasks with a pass"):
        table.add_column(column)
    for level in LEVELS if tasks_per_level else []:
        level_env = CodingEnvironment(levels=[level])
        tasks = [next(level_env.tasks("train", random.Random(seed + i))) for i in range(tasks_per_level)]
        solved = []
        for task in track(tasks, description=f"level {level}"):
            lines = first_lines(policy, tokenizer, task, samples, False, max_tokens)
            solved.append(list(scoring.map(lambda line, t=task: env.solved(t, line), lines)))
        passed = sum(map(sum, solved))
        table.add_row(f"train, level {level}", "temperature 1", str(len(tasks) * samples), str(passed),
                      f"{passed / (len(tasks) * samples):.1%}", str(sum(any(s) for s in solved)))
    held_env = CodingEnvironment(levels=heldout_levels or None)
    held = held_env.heldout(heldout, seed=seed)
    lines = [first_lines(policy, tokenizer, t, 1, True, max_tokens)[0] for t in track(held, description="held-out")]
    solved = list(scoring.map(held_env.solved, held, lines))
    levels = ", ".join(map(str, heldout_levels)) if heldout_levels else "all"
    table.add_row(f"held-out, levels {levels}", "greedy", str(len(held)), str(sum(solved)),
                  f"{sum(solved) / len(held):.1%}", "")
    console = Console()
    console.print(table)
    # A policy that learned the training split name by name answers a held-out task with a
    # training parameter's name where the task's own belongs.
    training_names = [line for line in lines if (word := re.match(r"\s*(\w+)", line)) and word[1] in PARAMS["train"]]
    console.print(f"held-out answers that begin with a parameter name of the training split: "
                  f"{len(training_names)} of {len(held)}")
    failed = [(task, line) for task, line, ok in zip(held, lines, solved, strict=True) if not ok][:examples]
    if failed:
        shown = Table(title=f"held-out tasks failed greedily (first {len(failed)})")
        for column in ("docstring", "answer", "reference"):
            shown.add_column(column)
        for task, line in failed:
            shown.add_row(task.prompt.split('"""')[1], repr(line), repr(task.reference))
        console.print(shown)


if __name__ == "__main__":
    typer.run(main)
