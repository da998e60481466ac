"""FSDP2 as the trainer uses it: which rank this is, and the model's weights gathered,
resharded or split as a parameter is. Alone (no process group), each is a no-op."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) under torchrun, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def resharded(model: torch.nn.Module) -> None:
    """Every FSDP module back to its shards: the root keeps its gathered weights after a
    forward without gradients, and a copy into those would not reach the shards."""
    for module in fsdp_modules(model):
        module.reshard()


@contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Every rank holds the whole weights of every FSDP module inside the block (a
    collective: every rank enters it)."""
    modules = fsdp_modules(model)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()


def like(parameter: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` split over the ranks as `parameter` is (itself when nothing is split)."""
    if isinstance(parameter, DTensor):
        return distribute_tensor(whole, parameter.device_mesh, parameter.placements)
    return whole
