"""A random-initialised MoE with a real model's per-layer shape, for measuring costs at size.

No model hub is reachable here, so a team's model of real size is stood in for by
Qwen3-30B-A3B's shape (hidden 2048, 128 experts top-8 of width 768, 32 query / 4 key-value
heads of 128, vocabulary 151,936) with fewer layers and, if asked, fewer experts. The
weights are random and seeded: the same arguments give the same bits on any CPU (torch's
CPU generator is machine-independent). Its tokenizer is the starter's, whose 2,048 ids are
the first rows of the vocabulary (ids above decode to nothing: rewards on text need them
not, rewards on token ids do not care).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen3MoeConfig

# Qwen3-30B-A3B's config.json, less the layer count (48) and what only long contexts need.
QWEN3_30B_A3B: dict[str, Any] = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
    tie_word_embeddings=False,
)
MARKER = "real_shape.json"


def real_shape_config(layers: int, experts: int = 128, pad_token_id: int = 0) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's per-layer shape with `layers` decoder layers of `experts` experts."""
    shape = dict(QWEN3_30B_A3B, num_hidden_layers=layers, num_experts=experts,
                 num_experts_per_tok=min(QWEN3_30B_A3B["num_experts_per_tok"], experts))
    return Qwen3MoeConfig(**shape, bos_token_id=pad_token_id, eos_token_id=pad_token_id,
                          pad_token_id=pad_token_id)


def parameter_count(config: Qwen3MoeConfig) -> int:
    """Parameters of a model of `config`, without building it."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def random_model(config: Qwen3MoeConfig, seed: int, dtype: torch.dtype = torch.bfloat16,
                 device: str = "cpu") -> PreTrainedModel:
    """The model of `config` with seeded random weights, in `dtype` on `device`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Qwen3-MoE initialises routers at zero (every expert tied): a trained router is not,
    # and a zero router makes every routing decision a tie that float noise breaks.
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    for name, weight in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            with torch.no_grad():
                weight.normal_(0.0, config.initializer_range, generator=generator)
    return model


def build_real_shape(out_dir: Path, tokenizer_dir: Path, *, layers: int = 1, experts: int = 128,
                     seed: int = 0) -> Path:
    """Write the model (HF format, bf16) and the tokenizer to out_dir, unless already there."""
    args = {"layers": layers, "experts": experts, "seed": seed, "shape": "Qwen3-30B-A3B"}
    marker = out_dir / MARKER
    if marker.exists() and json.loads(marker.read_text()) == args:
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = real_shape_config(layers, experts, pad_token_id=tokenizer.pad_token_id or 0)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"{tokenizer_dir}: its tokenizer has {len(tokenizer)} tokens, more than the "
                         f"shape's vocabulary of {config.vocab_size}")
    model = random_model(config, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    marker.write_text(json.dumps(args))
    return out_dir
