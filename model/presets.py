"""Named model configs, written as the HF `config.json` dicts they stand for.

`kimi-k3` and `kimi-linear-48b-a3b` carry the published values (for shape and memory planning);
`k3-tiny` has every K3 feature (q_lora + gated MLA, bounded KDA gate, full-rank KDA output gate,
latent MoE with MXFP4 experts and SiTU, attention residuals, dense first layer) at a size that
runs in milliseconds on a CPU. Keeping presets as raw dicts means they go through the same
parser as a checkpoint's config.json.
"""

from __future__ import annotations

import copy
from typing import Any

from k3serve.model.config import ConfigError, ModelConfig

_K3_MLA_LAYERS = list(range(4, 93, 4)) + [93]  # 1-based, as in the published config

KIMI_K3_TEXT: dict[str, Any] = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 163840,
    "hidden_size": 7168,
    "num_hidden_layers": 93,
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "intermediate_size": 33792,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_shared_experts": 2,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 12,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "linear_attn_config": {
        "full_attn_layers": _K3_MLA_LAYERS,
        "kda_layers": [i for i in range(1, 94) if i not in _K3_MLA_LAYERS],
        "head_dim": 128,
        "num_heads": 96,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
}

MXFP4_QUANTIZATION: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "mxfp4-pack-quantized",
            "weights": {"num_bits": 4, "group_size": 32, "type": "float", "strategy": "group", "symmetric": True},
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*", "re:.*gate$",
               "re:.*routed_expert_(down|up)_proj$"],
}

KIMI_K3: dict[str, Any] = {
    "model_type": "kimi_k3",
    "architectures": ["KimiK3ForConditionalGeneration"],
    "text_config": {**KIMI_K3_TEXT, "quantization_config": MXFP4_QUANTIZATION},
}

KIMI_LINEAR_48B_A3B: dict[str, Any] = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 163840,
    "hidden_size": 2304,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 72,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "intermediate_size": 9216,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 1048576,
    "bos_token_id": 163584,
    "eos_token_id": 163586,  # <|im_end|>
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
}

K3_TINY_TEXT: dict[str, Any] = {
    **KIMI_K3_TEXT,
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 2,
    "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 32,
    "attn_res_block_size": 3,
    "max_position_embeddings": 4096,
    "bos_token_id": None,  # filled from the tokenizer by make-checkpoint
    "eos_token_id": None,
    "linear_attn_config": {
        **KIMI_K3_TEXT["linear_attn_config"],
        "full_attn_layers": [3, 6, 7],  # like K3, the last two layers are both MLA
        "kda_layers": [1, 2, 4, 5],
        "head_dim": 16,
        "num_heads": 4,
    },
}

K3_TINY: dict[str, Any] = {
    "model_type": "kimi_k3",
    "architectures": ["KimiK3ForConditionalGeneration"],
    "text_config": {**K3_TINY_TEXT, "quantization_config": MXFP4_QUANTIZATION},
}

# k3-tiny with K3's per-head sizes (KDA head_dim 128, MLA latent 512 + rope 64) and MoE dims that are
# multiples of 64: small enough to write as a checkpoint and run on a CPU, but every op meets the GPU
# kernels' shape rules (the GPU engine tests and `benchmarks/gpu_engine.py`). Not a served preset.
K3_TINY_GPU_TEXT: dict[str, Any] = {
    **K3_TINY_TEXT,
    "hidden_size": 256,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "routed_expert_hidden_size": 128,
    "linear_attn_config": {**K3_TINY_TEXT["linear_attn_config"], "head_dim": 128, "num_heads": 12},
}

K3_TINY_GPU: dict[str, Any] = {
    "model_type": "kimi_k3",
    "architectures": ["KimiK3ForConditionalGeneration"],
    "text_config": {**K3_TINY_GPU_TEXT, "quantization_config": MXFP4_QUANTIZATION},
}

PRESETS: dict[str, dict[str, Any]] = {
    "kimi-k3": KIMI_K3,
    "kimi-linear-48b-a3b": KIMI_LINEAR_48B_A3B,
    "k3-tiny": K3_TINY,
    "k3-tiny-xtml": K3_TINY,  # k3-tiny speaking K3's own chat format (PRESET_CHAT_FORMATS)
}

CHAT_FORMATS = ("kimi_k2", "kimi_k3")
PRESET_CHAT_FORMATS: dict[str, str] = {"kimi-k3": "kimi_k3", "k3-tiny-xtml": "kimi_k3"}
"""The chat format a preset's tokenizer speaks, where it is not Kimi K2's (`<|im_user|>` turns, `<think>`, the
`<|tool_call_begin|>` markers): Kimi K3's XTML (model/xtml_chat.py). k3-tiny keeps K2's, as Kimi Linear speaks."""


def preset_chat_format(name: str) -> str:
    """The chat format of preset `name`'s tokenizer: one of CHAT_FORMATS."""
    return PRESET_CHAT_FORMATS.get(name, "kimi_k2")


def preset_hf_config(name: str) -> dict[str, Any]:
    """The HF config.json dict of a preset (a deep copy: callers may edit it)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def preset_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(preset_hf_config(name))


# ---- k3-rank-slice ---------------------------------------------------------------------------------------------
# One rank of Kimi-K3 served at TP 8 / EP 8, as a model of its own that one GPU serves at TP 1 (the GPU serving
# benchmark, `benchmarks/gpu_serving.sh`): the rank's KDA and MLA heads (12 of 96 each), dense MLP (4224 of
# 33792), shared experts (768 of 6144: `shared_expert_intermediate_size`), vocab rows (20480 of 163840) and
# routed experts (112 of 896, MXFP4, latent 3584 x 3072), hidden 7168 whole. A token picks 2 of the 112: the 16 of
# 896 it picks land 2 on a rank on average, so the rank's expert work per token is K3's. K3's first layers in
# K3's order (layer 1 KDA + dense MLP, then KDA + MoE, MLA + MoE at every 4th); `make-checkpoint --layers N` keeps
# the first N. The all-reduces TP 8 would add are not in it (benchmarks/gpu_serving.py models their cost).
K3_RANK_SLICE_TP = 8
K3_RANK_SLICE_LAYERS = 12

K3_RANK_SLICE_TEXT: dict[str, Any] = {
    **KIMI_K3_TEXT,
    "vocab_size": KIMI_K3_TEXT["vocab_size"] // K3_RANK_SLICE_TP,
    "num_hidden_layers": K3_RANK_SLICE_LAYERS,
    "num_attention_heads": KIMI_K3_TEXT["num_attention_heads"] // K3_RANK_SLICE_TP,
    "num_key_value_heads": KIMI_K3_TEXT["num_key_value_heads"] // K3_RANK_SLICE_TP,
    "intermediate_size": KIMI_K3_TEXT["intermediate_size"] // K3_RANK_SLICE_TP,
    "num_experts": KIMI_K3_TEXT["num_experts"] // K3_RANK_SLICE_TP,
    "num_experts_per_token": KIMI_K3_TEXT["num_experts_per_token"] // K3_RANK_SLICE_TP,
    "shared_expert_intermediate_size": (KIMI_K3_TEXT["moe_intermediate_size"] * KIMI_K3_TEXT["num_shared_experts"]
                                        // K3_RANK_SLICE_TP),
    "max_position_embeddings": 131072,
    "bos_token_id": None,  # filled from the tokenizer by make-checkpoint
    "eos_token_id": None,
    "linear_attn_config": {
        **KIMI_K3_TEXT["linear_attn_config"],
        "full_attn_layers": [i for i in _K3_MLA_LAYERS if i <= K3_RANK_SLICE_LAYERS],
        "kda_layers": [i for i in KIMI_K3_TEXT["linear_attn_config"]["kda_layers"] if i <= K3_RANK_SLICE_LAYERS],
        "num_heads": KIMI_K3_TEXT["linear_attn_config"]["num_heads"] // K3_RANK_SLICE_TP,
    },
}

K3_RANK_SLICE: dict[str, Any] = {
    "model_type": "kimi_k3",
    "architectures": ["KimiK3ForConditionalGeneration"],
    "text_config": {**K3_RANK_SLICE_TEXT, "quantization_config": MXFP4_QUANTIZATION},
}

PRESETS["k3-rank-slice"] = K3_RANK_SLICE
