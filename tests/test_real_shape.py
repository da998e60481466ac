"""The model of real shape that costs are measured against (`liverl policy real-shape`)."""

from __future__ import annotations

from policies.real_shape import parameter_count, real_shape_config


def test_the_real_shape_has_qwen3_30b_a3b_layers_and_vocabulary():
    config = real_shape_config(layers=1)
    assert (config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size) == (
        2048, 128, 8, 768, 32, 4, 128, 151936)
    # The figures: one full layer makes 1.25B parameters, two make 1.87B.
    assert round(parameter_count(config) / 1e9, 2) == 1.25
    assert round(parameter_count(real_shape_config(layers=2)) / 1e9, 2) == 1.87
    assert round(parameter_count(real_shape_config(layers=48)) / 1e9, 1) == 30.5
