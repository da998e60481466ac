"""Which parameter names does a policy copy? Level 1 of the coding environment asks for a
name back ("Return NAME unchanged."), and a held-out task passes or fails by its name, so
a policy's held-out rate is the share of tasks whose name it copies. Per name of a pool,
after `def evaluate(NAME):\\n    \"\"\"Return NAME unchanged.\"\"\"\\n    return`: the
probability of each of the name's tokens given the ones before it, the token the policy
would write instead where it is not the likeliest, and whether the greedy line is the name.

    .venv/bin/python benchmarks/bench_name_copy.py --model .liverl/starter --pool heldout
    .venv/bin/python benchmarks/bench_name_copy.py --model .liverl/starter --pool wide --summary
"""

from __future__ import annotations

from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from liverl.task_pools import PARAMS
from rollouts.coding import WIDE_PARAMS

POOLS = {"train": PARAMS["train"], "heldout": PARAMS["heldout"], "wide": WIDE_PARAMS}
console = Console()


def copy_steps(model, tokenizer, name: str) -> list[tuple[str, float, str, float]]:
    """Per token of ` NAME` and the line's end: (token, its probability, likeliest token, its probability)."""
    ids = tokenizer(f'def evaluate({name}):\n    """Return {name} unchanged."""\n    return').input_ids
    steps = []
    for want in tokenizer(" " + name).input_ids + tokenizer("\n").input_ids:
        with torch.no_grad():
            p = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        top = int(p.argmax())
        steps.append((tokenizer.decode([want]), float(p[want]), tokenizer.decode([top]), float(p[top])))
        ids.append(want)  # teacher-forced: the next step reads the name so far
    return steps


def main(model: Path = typer.Option(Path(".liverl/starter"), help="HF checkpoint."),
         pool: str = typer.Option("heldout", help=f"Parameter names: {', '.join(POOLS)}."),
         summary: bool = typer.Option(False, help="Only how many names of one token and of several are copied."),
         ) -> None:
    if pool not in POOLS:
        raise typer.BadParameter(f"no pool {pool!r} (one of {', '.join(POOLS)})", param_hint="--pool")
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    # Greedy copies the name where every step's token is the likeliest one.
    results = {name: copy_steps(policy, tokenizer, name) for name in POOLS[pool]}
    copied = {name: all(tok == top for tok, _, top, _ in steps) for name, steps in results.items()}
    if not summary:
        table = Table(title=f"{model}: names of the {pool} pool copied after `return`")
        for column in ("name", "copied", "token by token: p (the likeliest instead)"):
            table.add_column(column)
        for name, steps in results.items():
            table.add_row(name, "yes" if copied[name] else "no", " | ".join(
                f"{tok!r} {p:.3f}" + ("" if tok == top else f" ({top!r} {q:.2f})") for tok, p, top, q in steps))
        console.print(table)
    for tokens, label in ((lambda n: n == 2, "one token"), (lambda n: n > 2, "several tokens")):
        names = [name for name, steps in results.items() if tokens(len(steps))]
        console.print(f"{pool}, names of {label}: {sum(copied[n] for n in names)} of {len(names)} copied greedily")


if __name__ == "__main__":
    typer.run(main)
