"""What one held-out evaluation costs the evaluator (`rollouts/evaluate.py`): the greedy first
lines of `--tasks` coding tasks one by one against in batches (CPU seconds, one torch
thread, and whether the lines are the same), then a whole evaluation of the starter with an
empty (task, line) cache and again with the cache filled (wall seconds: the sandbox runs
are most of it).

    .venv/bin/python benchmarks/bench_heldout_eval.py --tasks 200 --runs 3
"""

from __future__ import annotations

import time

import torch
import typer
from transformers import AutoModelForCausalLM, AutoTokenizer

from liverl.settings import Settings
from policies.starter import build_starter_policy
from rollouts.coding import CodingEnvironment
from rollouts.evaluate import first_lines, greedy_first_lines, greedy_solved


def main(tasks: int = 200, runs: int = 3) -> None:
    torch.set_num_threads(1)
    model_dir = build_starter_policy(Settings().starter.cache_dir, progress=False)
    environment = CodingEnvironment(levels=[1, 2])
    held = environment.heldout(tasks)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for run in range(runs):
            started = time.process_time()
            one = [first_lines(model, tokenizer, task, 1, True, 16)[0] for task in held]
            alone = time.process_time() - started
            started = time.process_time()
            batched = greedy_first_lines(model, tokenizer, held, 16)
            together = time.process_time() - started
            same = sum(a == b for a, b in zip(one, batched, strict=True))
            print(f"run {run}: one by one {alone:.2f} s CPU, batched {together:.2f} s CPU, {same} of {tasks} "
                  "lines the same")
    known: dict[tuple[str, str], bool] = {}
    for label in ("empty cache", "cache filled"):
        started = time.time()
        solved = greedy_solved(model_dir, environment, held, known=known)
        print(f"whole evaluation, {label}: {time.time() - started:.2f} s wall, pass rate {sum(solved) / tasks:.3f}")


if __name__ == "__main__":
    typer.run(main)
