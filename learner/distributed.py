"""The learner on many ranks (torchrun): FSDP2 splits the model over them, rank 0 serves.

Rank 0 runs the learner service: it consumes Kafka, writes the registry and answers HTTP.
Every other rank holds its shards of the same `Trainer` and makes the same calls in the
same order, with the arguments rank 0 broadcasts (`Lockstep` there, `follow` here), so
each step, gather and save is a collective that every rank joins. Gloo carries it: the
trainer computes on CPU.

    LIVERL_LEARNER__RANKS=2 python -m learner.service   (starts torchrun itself)
    torchrun --nproc-per-node 2 -m learner.distributed MODEL_DIR SAMPLES.jsonl OUT_DIR

The second form is one step on a file of samples (tests, benchmarks): rank 0 writes the
candidate, its fp32 master weights and its metrics.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import typer
from safetensors.torch import save_file

from learner.sharding import rank_and_world
from learner.trainer import Trainer
from liverl.contracts import RewardedSample
from liverl.settings import get_settings

MASTER_FILE = "master.safetensors"
STOP = "stop"
_commands: dist.ProcessGroup | None = None  # where rank 0 broadcasts the calls to make


def run_on_ranks(ranks: int, module: str) -> None:
    """Replace this process with torchrun starting `ranks` copies of `module` (unless this
    already is one of them): one command starts the learner on any number of ranks."""
    if ranks > 1 and "WORLD_SIZE" not in os.environ:
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={ranks}", "-m", module])


def start() -> int:
    """Join the ranks if torchrun started this process; returns this rank (0 alone)."""
    global _commands
    if "WORLD_SIZE" not in os.environ:
        return 0
    dist.init_process_group("gloo")
    # The other ranks wait for rank 0's next call as long as it has no samples: no timeout
    # there, while a collective inside a step keeps gloo's default one.
    _commands = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    return dist.get_rank()


def finish() -> None:
    """Rank 0: let the other ranks go, then leave the group (every rank)."""
    if dist.is_initialized():
        if dist.get_rank() == 0:
            announce(STOP)
        dist.destroy_process_group()


def announce(name: str, *args, **kwargs) -> None:
    """Rank 0: tell every other rank which call to make next, with which arguments."""
    if rank_and_world()[1] > 1:
        dist.broadcast_object_list([(name, args, kwargs)], src=0, group=_commands)


class Lockstep:
    """Rank 0's trainer when there are several ranks: each method call is first announced,
    so every rank makes it on its own shards; attributes are read here."""

    def __init__(self, *args, **kwargs):
        announce("load", *args, **kwargs)
        self.trainer = Trainer(*args, **kwargs)

    def __getattr__(self, name: str):
        value = getattr(self.trainer, name)
        if not callable(value):
            return value

        def on_every_rank(*args, **kwargs):
            announce(name, *args, **kwargs)
            return value(*args, **kwargs)

        return on_every_rank


def trainer(*args, **kwargs):
    """A Trainer on every rank (as `Trainer(*args, **kwargs)`): the trainer itself when
    alone, else its `Lockstep` on rank 0."""
    return Lockstep(*args, **kwargs) if rank_and_world()[1] > 1 else Trainer(*args, **kwargs)


def follow() -> None:
    """Every rank but 0: make the calls rank 0 announces until it says stop."""
    # The stack stops a component by signalling its whole process group: this rank leaves
    # when rank 0 has finished what it was doing and says so (torchrun kills it otherwise).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    local: Trainer | None = None
    while True:
        call: list[Any] = [None]  # filled with (name, args, kwargs) by rank 0's broadcast
        dist.broadcast_object_list(call, src=0, group=_commands)
        name, args, kwargs = call[0]
        if name == STOP:
            return
        if name == "load":
            local = None  # the previous trainer's memory first
            local = Trainer(*args, **kwargs)
        else:
            getattr(local, name)(*args, **kwargs)


# --- one step from a file (torchrun) -------------------------------------------------------
def main(
    model_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="The version to train from."),
    samples: Path = typer.Argument(..., exists=True, dir_okay=False, help="Rewarded samples, one JSON per line."),
    out_dir: Path = typer.Argument(..., help="Where rank 0 writes the candidate."),
    seed: int = typer.Option(0, help="Seed of the minibatch order."),
) -> None:
    start()
    try:
        batch = [RewardedSample.model_validate_json(line)
                 for line in samples.read_text().splitlines() if line.strip()]
        step = Trainer(model_dir, get_settings().learner)
        metrics = step.train(batch, seed)
        master = step.export(out_dir)  # a collective: every rank takes part, rank 0 writes
        if rank_and_world()[0] == 0:
            save_file({k: v.contiguous() for k, v in master.items()}, out_dir / MASTER_FILE)
            (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        # The others wait for rank 0's writing: a rank that tore gloo down and exited while
        # rank 0 still wrote aborted once ("terminate called without an active exception").
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    typer.run(main)
