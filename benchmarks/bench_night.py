"""The day's first lend, fast: what the first versions trained on the night's rollout groups
do to the held-out coding skill (issue 46). One process, no broker, vLLM or guard, as
`bench_mix.py` (whose groups it samples).

In the day demo the first trough lends a replica for about 26 s while the starter serves it
(a lent replica follows the learner every `capacity.refresh_s`, 30 s), so about a hundred
groups, all sampled from the starter, train the first eight versions one after the other
(96 samples, twelve groups, each). Here: `--versions` x 12 coding groups of 8 (levels 1-2,
wide names, temperature 1) sampled from the starter, trained as that many versions with the
demo's learner (`--set` overrides its fields); with `--on-policy`, each version's groups are
sampled from the weights the previous version published instead (a replica that follows
the learner at every version). Held-out: 200 tasks greedily (`rollouts/evaluate.py`, as the
evaluator) at the start, after the first version, the fourth and the last.

    .venv/bin/python benchmarks/bench_night.py --seeds 0 --seeds 1 --seeds 2 --seeds 3 --jobs 2
    .venv/bin/python benchmarks/bench_night.py --set max_kl_from_parent=0.15
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from bench_ablation import learner_config, published  # noqa: E402
from bench_mix import groups  # noqa: E402

from learner.trainer import Trainer  # noqa: E402
from liverl.settings import Settings  # noqa: E402
from policies.starter import build_starter_policy  # noqa: E402
from rollouts.coding import CodingEnvironment  # noqa: E402
from rollouts.evaluate import greedy_solved  # noqa: E402

console = Console()
GROUPS_PER_VERSION, GROUP_SIZE = 12, 8


def run(seed: int, overrides: dict, versions: int, on_policy: bool, heldout: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model_dir = build_starter_policy(Settings().starter.cache_dir, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    trainer = Trainer(model_dir, learner_config(overrides))
    served = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    env = CodingEnvironment(levels=[1, 2], train_params="wide")
    tasks, held = env.tasks("train", random.Random(seed)), env.heldout(heldout)
    scratch, known = Path(tempfile.mkdtemp(prefix="bench-night-")), {}

    def evaluate() -> float:
        trainer.export(scratch / "eval")
        return sum(greedy_solved(scratch / "eval", env, held, known=known)) / len(held)

    night = [] if on_policy else groups(env, tasks, served, tokenizer, 0, 0, GROUPS_PER_VERSION * versions,
                                        GROUP_SIZE)
    heldout_at, versions_metrics = {0: evaluate()}, []
    for k in range(versions):
        if on_policy:
            served.load_state_dict(published(trainer))
            batch = groups(env, tasks, served, tokenizer, k, k, GROUPS_PER_VERSION, GROUP_SIZE)
        else:
            batch = night[k * GROUPS_PER_VERSION * GROUP_SIZE:(k + 1) * GROUPS_PER_VERSION * GROUP_SIZE]
        metrics = trainer.train(batch, seed=k)
        versions_metrics.append({key: metrics.get(key) for key in ("kl_from_parent", "lr", "backtracks")})
        if k + 1 in (1, 4, versions):
            heldout_at[k + 1] = evaluate()
    return {"seed": seed, "heldout": heldout_at, "versions": versions_metrics}


def main(seeds: list[int] = typer.Option([0, 1], "--seeds"), versions: int = 8,
         on_policy: bool = typer.Option(False, help="Sample each version's groups from the previous version."),
         heldout: int = 200, jobs: int = 1,
         set_: list[str] = typer.Option([], "--set", help="LearnerConfig field=value"),
         out: Path | None = typer.Option(None, help="Write the runs as JSON here.")) -> None:
    overrides = {key: json.loads(value) for key, _, value in (item.partition("=") for item in set_)}
    learner_config(overrides)  # a bad setting stops here
    build_starter_policy(Settings().starter.cache_dir)
    with ProcessPoolExecutor(jobs) as pool:
        n = len(seeds)
        results = list(pool.map(run, seeds, [overrides] * n, [versions] * n, [on_policy] * n, [heldout] * n))
    title = f"{versions} versions of the night's groups ({'on-policy' if on_policy else 'all from the starter'})"
    table = Table(title=f"{title} {overrides or ''}: held-out pass rate")
    for column in ("seed", "starter", "v1", "v4", f"v{versions}", "KL of v1", "largest KL", "backtracks"):
        table.add_column(column, justify="right")
    for r in results:
        h, kls = r["heldout"], [v["kl_from_parent"] for v in r["versions"]]
        table.add_row(str(r["seed"]), *(f"{h[k]:.3f}" if k in h else "" for k in (0, 1, 4, versions)), f"{kls[0]:.3f}",
                      f"{max(kls):.3f}", str(sum(v["backtracks"] or 0 for v in r["versions"])))
    ends = [r["heldout"][versions] for r in results]
    table.add_row("median", "", "", "", f"{statistics.median(ends):.3f}", "", "", "")
    console.print(table)
    if out:
        out.write_text(json.dumps({"overrides": overrides, "on_policy": on_policy, "runs": results}, indent=1))


if __name__ == "__main__":
    typer.run(main)
