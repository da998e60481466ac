"""Issue 14's calibration bar, one experiment: does a starter mid-trained with a primer of
documented one-line functions pass at least 5% of the coding environment's level 1 at
temperature 1, and at most 30% of held-out tasks greedily?

The starter (`policies/starter.py`) almost never copies a parameter name after `return`
(0.2% of level 1). This builds a variant of it, without touching the recipe: the same
stdlib corpus plus `--functions` short functions appended to the token stream, each

    def fetch(archive):
        \"\"\"Return archive unchanged.\"\"\"
        return archive

(four phrasings of level 1; `--level2-share` of them "Return x plus/times/minus k"), with
names drawn from the tokenizer's single-token lower-case words minus the coding
environment's train and held-out pools (and keywords and builtins), and constants outside
both splits' pools, so no task of either split is in the primer. Then it samples level 1
and level 2 (`--tasks` tasks x 16 at temperature 1, transformers' default top-k of 50, as
`bench_coding_env.py`) and 200 held-out tasks greedily, scored in the sandbox, and probes
whether the copy generalises: the greedy next token after `return` for names in and out
of the primer's pool.

    .venv/bin/python benchmarks/bench_starter_primer.py --functions 40000 --steps 3000 --out /tmp/primer
"""

from __future__ import annotations

import builtins
import json
import keyword
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

import policies.starter as starter
from rollouts.coding import CONSTANTS, NAMES, PARAMS, CodingEnvironment
from rollouts.evaluate import first_lines

console = Console()
SPLIT_NAMES = set(NAMES["train"]) | set(NAMES["heldout"]) | set(PARAMS["train"]) | set(PARAMS["heldout"])
LEVEL1 = ["Return {a} unchanged.", "Return {a} as it is.", "Return {a}.", "Give back {a}."]
LEVEL2 = [("Return {a} plus {k}.", "{a} + {k}"), ("Return {a} times {k}.", "{a} * {k}"),
          ("Return {a} minus {k}.", "{a} - {k}")]


def name_pool(tokenizer) -> list[str]:
    """Lower-case words that are one token after a space, none of them a task's name."""
    banned = SPLIT_NAMES | set(keyword.kwlist) | set(dir(builtins))
    words = {tokenizer.convert_tokens_to_string([t]).strip() for t in tokenizer.get_vocab()}
    return sorted(w for w in words if re.fullmatch(r"[a-z][a-z0-9_]{1,11}", w) and w not in banned
                  and len(tokenizer(" " + w)["input_ids"]) == 1)


def primer(tokenizer, count: int, level2_share: float, compound_share: float, seed: int = 0) -> list[str]:
    """`count` functions; a `compound_share` of their parameters are two pool words joined by
    an underscore (170,000 such names: too many to memorise one by one, so only copying the
    name from the header predicts it)."""
    rng = random.Random(seed)
    names = name_pool(tokenizer)
    constants = [k for k in range(1, 100) if k not in CONSTANTS["train"] + CONSTANTS["heldout"]]
    functions = []
    for _ in range(count):
        function, a, k = rng.choice(names), rng.choice(names), rng.choice(constants)
        if compound_share and rng.random() < compound_share:  # no draw at 0: the rows before it reproduce
            a = f"{a}_{rng.choice(names)}"
        doc, answer = rng.choice(LEVEL2) if rng.random() < level2_share else (rng.choice(LEVEL1), "{a}")
        functions.append(f'def {function}({a}):\n    """{doc.format(a=a, k=k)}"""\n'
                         f'    return {answer.format(a=a, k=k)}\n')
    return functions


def build(out: Path, functions: int, level2_share: float, compound_share: float, steps: int, tie: bool) -> Path:
    plain = starter.token_stream
    if tie:  # this process only, as the primer: input and output embeddings are one matrix
        untied = starter.Qwen3MoeConfig
        starter.Qwen3MoeConfig = lambda **config: untied(**{**config, "tie_word_embeddings": True})

    def with_primer(files, tokenizer):
        ids = []
        for text in primer(tokenizer, functions, level2_share, compound_share):
            ids.extend(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])
        corpus = plain(files, tokenizer)
        console.print(f"primer: {len(ids):,} of {len(corpus) + len(ids):,} tokens "
                      f"({len(ids) / (len(corpus) + len(ids)):.0%})")
        return torch.cat([corpus, torch.tensor(ids)])

    starter.token_stream = with_primer  # this process only: the recipe file is unchanged
    model_dir = starter.build_starter_policy(out, train_steps=steps)
    if tie:
        untie(model_dir)
    return model_dir


def untie(model_dir: Path) -> None:
    """Save the checkpoint with `lm_head` a copy of the embeddings: the learner, the delta
    codec and vLLM's weight updates take untied checkpoints; equal now, free to part in RL."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(model_dir)


def copy_probe(model, tokenizer, names: list[str]) -> dict[str, tuple[str, float]]:
    """Per name, the greedy token after a level-1 prompt and its probability."""
    out = {}
    for a in names:
        ids = tokenizer(f'def fetch({a}):\n    """Return {a} unchanged."""\n    return', return_tensors="pt").input_ids
        with torch.no_grad():
            p = torch.softmax(model(ids).logits[0, -1], -1)
        out[a] = (tokenizer.decode([int(p.argmax())]), round(float(p.max()), 3))
    return out


def main(functions: int = typer.Option(40000, min=1, help="Primer functions appended to the corpus."),
         level2_share: float = typer.Option(0.2, help="Share of them that add, multiply or subtract."),
         compound_share: float = typer.Option(0.0, help="Share of parameter names made of two pool words."),
         steps: int = typer.Option(3000, help="Mid-training steps (the starter's recipe: 600)."),
         tasks: int = typer.Option(20, help="Training tasks per level sampled 16 times at temperature 1."),
         tie: bool = typer.Option(False, help="Tie the input and output embeddings (the recipe does not)."),
         out: Path = typer.Option(Path("/tmp/starter-primer"))) -> None:
    model_dir = build(out, functions, level2_share, compound_share, steps, tie)
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
    table = Table(title=f"starter with {functions} primer functions ({compound_share:.0%} compound names), "
                        f"{steps} steps")
    table.add_column("tasks")
    table.add_column("pass rate")
    for name, rate in rates.items():
        table.add_row(name, f"{rate:.1%}")
    console.print(table)
    pool = name_pool(tokenizer)
    probe = copy_probe(model, tokenizer, pool[:: max(1, len(pool) // 8)][:8] + PARAMS["train"][:4] + PARAMS["heldout"][:4])
    console.print("greedy token after `return` (in the primer's pool, then the train and held-out names):")
    console.print(json.dumps(probe))


if __name__ == "__main__":
    typer.run(main)
