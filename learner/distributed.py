"""The learner's training step under torchrun: data parallel with FSDP2 over the ranks.

    torchrun --nproc-per-node 2 -m learner.distributed MODEL_DIR SAMPLES.jsonl OUT_DIR

Each rank trains on its share of every minibatch; FSDP2 shards weights, gradients and
Adam state per decoder layer. Rank 0 writes the candidate (HF, bf16, with its probe),
its fp32 master weights and its metrics. Gloo on CPU; the settings are the learner's
(LIVERL_LEARNER__* environment variables).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
import typer
from safetensors.torch import save_file

from learner.trainer import Trainer
from liverl.contracts import RewardedSample
from liverl.settings import get_settings

MASTER_FILE = "master.safetensors"


def main(
    model_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="The version to train from."),
    samples: Path = typer.Argument(..., exists=True, dir_okay=False, help="Rewarded samples, one JSON per line."),
    out_dir: Path = typer.Argument(..., help="Where rank 0 writes the candidate."),
    seed: int = typer.Option(0, help="Seed of the minibatch order."),
) -> None:
    dist.init_process_group("gloo")
    try:
        batch = [RewardedSample.model_validate_json(line)
                 for line in samples.read_text().splitlines() if line.strip()]
        trainer = Trainer(model_dir, get_settings().learner)
        metrics = trainer.train(batch, seed)
        master = trainer.master_state()  # a collective: every rank takes part
        if dist.get_rank() == 0:
            trainer.export(out_dir, master)
            save_file({k: v.contiguous() for k, v in master.items()}, out_dir / MASTER_FILE)
            (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        # The others wait for rank 0's writing: a rank that tore gloo down and exited while
        # rank 0 still wrote aborted once ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    typer.run(main)
