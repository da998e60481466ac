"""Router replay: train through exactly the experts inference chose.

In an MoE a tiny numeric difference between the inference engine and the trainer can
flip a token's top-k experts, so the trainer would score the token under a different
network than the one that sampled it. Inference records the expert ids per token and
layer; here the learner's routers keep their own softmax (so router weights still get
gradients) but take the top-k *indices* from the record (Ma et al. 2025, "Stabilizing
MoE RL by aligning training and inference routers", R3).
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from policies.families import is_router


def moe_routers(model: torch.nn.Module) -> list[Any]:
    """The top-k routers, one per MoE layer, in layer order. Any: each family's router
    module has its own attributes (hidden_dim, top_k, ...), and `install` adds replay,
    recomputed and used, none of which torch's Module type knows."""
    return [m for m in model.modules() if is_router(m)]


def _routed_forward(router: Any, hidden_states: torch.Tensor):
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden_states, router.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    recomputed = torch.topk(probs, router.top_k, dim=-1).indices
    router.recomputed = recomputed
    indices = recomputed
    if router.replay is not None:
        # Tokens without a record (-1) keep the recomputed choice.
        known = (router.replay >= 0).all(dim=-1, keepdim=True)
        indices = torch.where(known, router.replay, recomputed)
    router.used = indices
    weights = probs.gather(-1, indices)
    # Mixtral's router has no such flag: it always renormalises its top-k.
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), indices


def install(model: torch.nn.Module) -> None:
    """Make the model's routers replayable (a no-op until `replay` is given a record)."""
    for router in moe_routers(model):
        router.replay = None
        router.recomputed = None
        router.used = None
        router.forward = types.MethodType(_routed_forward, router)


@contextmanager
def replay(model: torch.nn.Module, routing: torch.Tensor | None):
    """Force routing for one forward/backward: `routing` is [layers, batch*seq, top_k]."""
    routers = moe_routers(model)
    for layer, router in enumerate(routers):
        router.replay = None if routing is None else routing[layer]
    try:
        yield
    finally:
        for router in routers:
            router.replay = None


def recomputed_routing(model: torch.nn.Module) -> torch.Tensor:
    """[layers, batch*seq, top_k]: what the routers would choose on the last forward."""
    return torch.stack([r.recomputed for r in moe_routers(model)])


def used_routing(model: torch.nn.Module) -> torch.Tensor:
    """[layers, batch*seq, top_k]: the experts the last forward actually ran."""
    return torch.stack([r.used for r in moe_routers(model)])


def routing_mismatch(recomputed: torch.Tensor, served: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of (token, layer) pairs whose expert *set* differs from the served one."""
    same = (recomputed.sort(-1).values == served.sort(-1).values).all(-1)  # [layers, tokens]
    known = (served >= 0).all(-1) & mask.reshape(1, -1).bool()
    return ((~same) & known).sum().item() / max(known.sum().item(), 1)
