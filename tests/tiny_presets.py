"""Tiny HF configs that the presets do not ship, written as the config.json dicts they stand for.

`kimi_linear_tiny()` is Kimi-Linear-48B-A3B shrunk to CPU size. It keeps every feature in which
Kimi Linear differs from K3, so the tests cover both members of the family:

    KDA gate         softplus (no gate_lower_bound)      K3: bounded "safe" gate
    KDA output gate  low-rank g_a_proj / g_b_proj        K3: full-rank g_proj
    MLA              q_proj (no q_lora), no output gate  K3: q_a/q_b + g_proj
    MoE              plain, bf16 experts, silu           K3: latent, MXFP4 experts, SiTU
    residual stream  plain                               K3: attention residuals
    config layout    flat, tensors under `model.`        K3: VL `text_config`, `language_model.`
"""

from __future__ import annotations

from typing import Any

from k3serve.model.presets import preset_hf_config


def kimi_linear_tiny() -> dict[str, Any]:
    hf = preset_hf_config("kimi-linear-48b-a3b")
    hf.update(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=128,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        max_position_embeddings=4096,
        bos_token_id=None,  # filled from the tokenizer by make_checkpoint
        eos_token_id=None,
    )
    hf["linear_attn_config"].update(
        full_attn_layers=[4, 6],  # like Kimi Linear: every 4th layer and the last one are MLA
        kda_layers=[1, 2, 3, 5],
        head_dim=16,
        num_heads=4,
    )
    return hf


def k3_tiny_odd_vocab() -> dict[str, Any]:
    """k3-tiny with a vocab of 509 (prime): no TP size > 1 divides it, so the vocab-parallel embedding and
    lm_head pad their last rank's rows."""
    hf = preset_hf_config("k3-tiny")
    hf["text_config"]["vocab_size"] = 509
    return hf
