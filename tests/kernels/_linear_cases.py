"""The weights a K3 decode step multiplies on one rank at TP8 (hidden 7168), read off the model's own layers
built on the meta device, so the GPU test and benchmarks/gpu_linear.py follow any change to the stacking."""

from __future__ import annotations

import torch

from k3serve.model.layers.kda import KimiDeltaAttention
from k3serve.model.layers.mla import MLAAttention
from k3serve.model.layers.mlp import DenseMLP, SparseMoE, glu_activation
from k3serve.model.layers.vocab import ParallelLMHead
from k3serve.model.parallel import TensorParallel
from k3serve.model.presets import preset_config


def k3_rank_weights() -> list[tuple[str, int, int]]:
    """(name, N, K) of every decode-step GEMM weight of one K3 rank at TP8, the router's included."""
    cfg, tp, dtype = preset_config("kimi-k3"), TensorParallel(0, 8), torch.bfloat16
    with torch.device("meta"):
        kda, mla = KimiDeltaAttention(cfg, tp, dtype), MLAAttention(cfg, tp, dtype)
        moe = SparseMoE(cfg, tp, dtype)
        dense = DenseMLP(cfg.hidden_size, cfg.intermediate_size, glu_activation(cfg), tp, dtype)
        lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
    weights = {
        "KDA stacked q|k|v|f_a|b|g": kda.x_proj_weight,
        "KDA f_b_proj": kda.f_b_proj.weight,
        "KDA o_proj": kda.o_proj.weight,
        "MLA stacked q_a|kv_a|g": mla.x_proj_weight,
        "MLA q_b_proj": mla.q_b_proj.weight,
        "MLA o_proj": mla.o_proj.weight,
        "MoE stacked latent down|shared gate|up": moe.x_proj_weight,
        "MoE router": moe.gate.weight,
        "MoE latent up": moe.routed_expert_up_proj.weight,
        "MoE shared down": moe.shared_experts.down_proj.weight,
        "dense MLP gate|up": dense.gate_up_weight,
        "dense MLP down": dense.down_proj.weight,
        "lm_head shard": lm_head.weight,
    }
    return [(name, *w.shape) for name, w in weights.items()]
