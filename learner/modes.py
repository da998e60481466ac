"""What the learner trains of a policy, what it publishes, and whether that fits in memory.

- full weights (fp32 master weights and Adam state), less any `learner.frozen_parameters`:
  a named subset (attention and routers, say) is trained in full this way;
- LoRA (`learner.lora`): low-rank adapters through peft on the frozen base, attention
  projections as modules and routers as parameters (`target_parameters`: transformers 5
  keeps routers and experts as raw parameters). A version publishes the base with the
  adapters merged, so a replica serves and swaps it as any other version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from learner.logprobs import causal_lm

if TYPE_CHECKING:  # the settings need pydantic; this module runs where only torch is (the GPU benchmark)
    from liverl.settings import LoraConfig

ROUTER_WEIGHT = "mlp.gate.weight"
EXPERT_STACKS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
GIB = 1024**3


def with_adapters(model: torch.nn.Module, rank: int, alpha: int, targets: list[str],
                  router: bool = True, experts: bool = False) -> torch.nn.Module:
    """`model` wrapped by peft with adapters of rank `rank` on `targets` (and its routers;
    `experts`: the 3-D expert stacks too, which peft merges into a weight the size of the
    stack at every forward: benchmarks/bench_learner_size.py measures it, the learner does
    not offer it)."""
    from peft import LoraConfig, get_peft_model

    names = [n for n, _ in model.named_parameters()]
    wanted = ([ROUTER_WEIGHT] if router else []) + (EXPERT_STACKS if experts else [])
    parameters = [w for w in wanted if any(n.endswith(w) for n in names)]
    # A's random start from a fixed seed: every rank (FSDP shards what each one made) and
    # every run from the same version starts from the same adapters.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                target_parameters=parameters or None))


def freeze(model: torch.nn.Module, frozen: list[str]) -> None:
    """Train every weight but those whose names contain one of `frozen`."""
    names = [name for name, _ in model.named_parameters()]
    if unmatched := [part for part in frozen if not any(part in name for name in names)]:
        raise ValueError(f"learner.frozen_parameters: {unmatched} name no weight of this policy "
                         f"(its weights: {', '.join(names[:4])}, ...)")
    for name, weight in model.named_parameters():
        weight.requires_grad_(not any(part in name for part in frozen))


def _base_name(name: str) -> str:
    """A peft-wrapped weight's name in the base model's checkpoint."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def adapted_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a version changes, in fp32 by checkpoint name: each adapted base weight with its
    adapter merged (W + (alpha/r) B @ A) for a peft model, else the trained weights."""
    from peft.tuners.lora import LoraLayer

    adapted = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            param = getattr(module, "parameter_name", "weight")  # a router's ParamWrapper names its parameter
            weight = getattr(module.get_base_layer(), param)
            # Every concrete LoRA layer defines get_delta_weight; peft's LoraLayer base does not declare it.
            delta = module.get_delta_weight("default")  # type: ignore[attr-defined]
            adapted[_base_name(f"{name}.{param}")] = (weight + delta).detach()
    return adapted or {n: w.detach() for n, w in model.named_parameters() if w.requires_grad}


def published_state(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None,
                    merged: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The full checkpoint a version publishes (fp32; exported rounded to bf16): the model's
    weights (or `state`, its whole state dict gathered from FSDP shards), adapters merged
    in (`merged`: `adapted_weights` made while the shards were gathered)."""
    state = causal_lm(model).state_dict() if state is None else state
    if not hasattr(model, "peft_config"):
        return state
    merged = adapted_weights(model) if merged is None else merged
    return {_base_name(n): merged.get(_base_name(n), t) for n, t in state.items() if ".lora_" not in n}


def published_view(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Overrides that make `model` compute with exactly the published (bf16) values of what
    training changed, by the model's own parameter names (for torch.func.functional_call;
    a peft model's adapters must be disabled around the call)."""
    if not hasattr(model, "peft_config"):
        return {n: w.detach().to(torch.bfloat16).float() for n, w in model.named_parameters() if w.requires_grad}
    merged = adapted_weights(model)
    return {n: merged[_base_name(n)].to(torch.bfloat16).float()
            for n, _ in model.named_parameters() if _base_name(n) in merged and ".lora_" not in n}


@dataclass(frozen=True)
class Footprint:
    """Bytes the learner holds between steps, before activations."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def footprint(total_params: int, trained_params: int, weight_bytes: int = 4) -> Footprint:
    """The model at `weight_bytes` a value (fp32 master weights: 4), plus for each trained
    value an fp32 gradient and Adam's two fp32 moments (an adapter's own weights count as
    trained values beside the base)."""
    return Footprint(weights=total_params * weight_bytes, gradients=trained_params * 4,
                     optimizer=trained_params * 8)


def lora_params(model: torch.nn.Module, rank: int, targets: list[str], router: bool = True) -> int:
    """Adapter values of rank `rank` on the `targets` modules (and the routers)."""
    count = sum(rank * (m.in_features + m.out_features) for n, m in model.named_modules()
                if n.rsplit(".", 1)[-1] in targets and isinstance(m, torch.nn.Linear))
    if router:
        count += sum(rank * sum(w.shape) for n, w in model.named_parameters() if n.endswith(ROUTER_WEIGHT))
    return count


def too_big(model: torch.nn.Module, trained: int, available: int, lora: LoraConfig) -> str | None:
    """Why training `trained` of `model`'s values cannot fit in `available` bytes, naming
    what would fit (adapters as `lora` says); None if it fits."""
    total = sum(p.numel() for p in model.parameters())
    need = footprint(total, trained)
    if need.total <= available:
        return None
    adapters = footprint(total, lora_params(model, lora.rank, lora.targets, lora.router))
    hint = (f"LoRA rank {lora.rank} (LIVERL_LEARNER__LORA) needs about {adapters.total / GIB:.1f} GiB"
            if adapters.total <= available else "no mode fits: this policy needs a larger machine")
    return (f"the learner needs about {need.total / GIB:.1f} GiB for {total / 1e9:.2f}B weights in fp32 with "
            f"{trained / 1e9:.2f}B trained (gradients and Adam), {available / GIB:.1f} GiB is available; {hint}")


def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable: free plus reclaimable cache)."""
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) * 1024
