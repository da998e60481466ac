"""Issue 14's calibration bar, one experiment per run: does a starter built with these
primer and mid-training settings pass at least 5% of the coding environment's level 1 at
temperature 1, and at most 30% of held-out tasks greedily?

It builds the starter's recipe (`policies/starter.py`) with the settings given, in a
directory of its own: the stdlib corpus plus `--functions` primer functions
(`policies/primer.py`: four phrasings of level 1, `--level2-share` of them "Return x
plus/times/minus k", no name or constant of either split), `--steps` of mid-training,
embeddings tied during it or not (`--tie/--no-tie`). The recipe's own settings are the
defaults (40,000 functions, 3000 steps, tied). Then it samples level 1 and level 2
(`--tasks` tasks x 16 at temperature 1, transformers' default top-k of 50, as
`bench_coding_env.py`) and 200 held-out tasks greedily, scored in the sandbox, and probes
whether the copy generalises: the greedy next token after `return` for names in and out
of the primer's pool.

    .venv/bin/python benchmarks/bench_starter_primer.py --functions 20000 --steps 1200 --no-tie --out /tmp/primer
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from liverl.task_pools import PARAMS
from policies.primer import name_pool
from policies.starter import build_starter_policy
from rollouts.coding import CodingEnvironment
from rollouts.evaluate import first_lines

console = Console()


def copy_probe(model, tokenizer, names: list[str]) -> dict[str, tuple[str, float]]:
    """Per name, the greedy token after a level-1 prompt and its probability."""
    out = {}
    for a in names:
        ids = tokenizer(f'def fetch({a}):\n    """Return {a} unchanged."""\n    return', return_tensors="pt").input_ids
        with torch.no_grad():
            p = torch.softmax(model(ids).logits[0, -1], -1)
        out[a] = (tokenizer.decode([int(p.argmax())]), round(float(p.max()), 3))
    return out


def main(functions: int = typer.Option(40000, min=0, help="Primer functions appended to the corpus."),
         level2_share: float = typer.Option(0.2, help="Share of them that add, multiply or subtract."),
         steps: int = typer.Option(3000, help="Mid-training steps."),
         tasks: int = typer.Option(20, help="Training tasks per level sampled 16 times at temperature 1."),
         tie: bool = typer.Option(True, help="Tie the input and output embeddings during mid-training."),
         hidden_size: int = typer.Option(128, help="The model's width (the recipe's: 128)."),
         layers: int = typer.Option(3, help="Transformer layers (the recipe's: 3)."),
         out: Path = typer.Option(Path("/tmp/starter-primer"))) -> None:
    model_dir = build_starter_policy(out, train_steps=steps, primer_functions=functions,
                                     primer_level2_share=level2_share, tie_embeddings=tie,
                                     hidden_size=hidden_size, num_layers=layers)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    env, scoring = CodingEnvironment(), ThreadPoolExecutor(4)
    rates = {}
    with torch.no_grad():
        for level in (1, 2):
            level_env = CodingEnvironment(levels=[level])
            drawn = [next(level_env.tasks("train", random.Random(i))) for i in range(tasks)]
            passed = sum(sum(scoring.map(lambda line, t=t: env.solved(t, line), first_lines(model, tokenizer, t, 16,
                                                                                            False, 16)))
                         for t in drawn)
            rates[f"train level {level}, temperature 1"] = passed / (16 * tasks)
        held = env.heldout(200, seed=0)
        lines = [first_lines(model, tokenizer, t, 1, True, 16)[0] for t in held]
        rates["held-out (200, all levels), greedy"] = sum(scoring.map(env.solved, held, lines)) / len(held)
    table = Table(title=f"starter of width {hidden_size}, {layers} layers, {functions} primer functions, "
                        f"{steps} steps, embeddings {'tied' if tie else 'untied'} in mid-training")
    table.add_column("tasks")
    table.add_column("pass rate")
    for name, rate in rates.items():
        table.add_row(name, f"{rate:.1%}")
    console.print(table)
    pool = name_pool(tokenizer)
    probe = copy_probe(model, tokenizer,
                       pool[:: max(1, len(pool) // 8)][:8] + PARAMS["train"][:4] + PARAMS["heldout"][:4])
    console.print("greedy token after `return` (in the primer's pool, then the train and held-out names):")
    console.print(json.dumps(probe))


if __name__ == "__main__":
    typer.run(main)
