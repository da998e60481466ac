"""What the learner trains of a policy, and whether that fits in memory.

- full: every weight, fp32 master weights and Adam state for all of them.
- subset: only weights whose names contain one of `trainable` (attention and routers by
  default); the rest stay frozen.
- lora: low-rank adapters through peft on the frozen base, which stays in bf16 (its
  published rounding): attention projections as modules, routers as parameters
  (`target_parameters`; in transformers 5 routers and experts are raw parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Mode = Literal["full", "subset", "lora"]

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ROUTERS = ["mlp.gate.weight"]
SUBSET = ["self_attn.", "mlp.gate."]


@dataclass(frozen=True)
class Footprint:
    """Bytes a mode holds between steps, before activations."""

    weights: int
    trainable: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.trainable + self.optimizer


def footprint(total_params: int, trainable_params: int, mode: Mode) -> Footprint:
    """fp32 master weights (full, subset) or a bf16 base (lora); a gradient and Adam's two
    moments (fp32) per trained value."""
    weights = total_params * (2 if mode == "lora" else 4)
    extra = trainable_params * 4 if mode == "lora" else 0  # the adapters' own fp32 weights
    return Footprint(weights=weights + extra, trainable=trainable_params * 4, optimizer=trainable_params * 8)


def lora_trainable(model: torch.nn.Module, rank: int) -> int:
    """Adapter parameters of rank `rank` on the attention projections and routers."""
    count = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ATTENTION and isinstance(module, torch.nn.Linear):
            count += rank * (module.in_features + module.out_features)
    for name, weight in model.named_parameters():
        if any(name.endswith(r) for r in ROUTERS):
            count += rank * sum(weight.shape)
    return count


def subset_trainable(model: torch.nn.Module, parts: list[str]) -> int:
    return sum(w.numel() for n, w in model.named_parameters() if any(p in n for p in parts))


def apply_mode(model: torch.nn.Module, mode: Mode, *, lora_rank: int = 16, lora_alpha: int = 32,
               subset: list[str] = SUBSET) -> torch.nn.Module:
    """The model to train in `mode` (a peft model for lora), its trained weights marked."""
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        targets = [r for r in ROUTERS if any(n.endswith(r) for n, _ in model.named_parameters())]
        return get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=ATTENTION,
                                                target_parameters=targets or None))
    for name, weight in model.named_parameters():
        weight.requires_grad_(mode == "full" or any(p in name for p in subset))
    return model


def adapted_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a replica would serve of the tensors an update touches: the trained weights
    themselves, or for lora each adapted base weight with its adapter merged (W + s*B@A),
    by the base model's weight names. Nothing else is copied."""
    from peft.tuners.lora import LoraLayer

    adapted = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            param = getattr(module, "parameter_name", "weight")
            weight = getattr(base, param)
            key = f"{name.removeprefix('base_model.model.')}.{param}"
            adapted[key] = (weight + module.get_delta_weight("default").to(weight.dtype)).detach()
    if not adapted:
        adapted = {n: w.detach() for n, w in model.named_parameters() if w.requires_grad}
    return adapted
