"""K3 attention residuals: each aggregation point mixes the frozen block snapshots ("bank") and the
current block's partial sum ("prefix") with a per-token softmax (model/K3_MODEL.md §1f).

`attn_res_aggregate` checks shapes here, then runs `triton_attn_res.py` (one launch, the prefix
update before and the RMSNorm after included) when every tensor is on CUDA, else the fp32 reference in `naive.py`;
`last_backend["attn_res_aggregate"]` records which."""

from __future__ import annotations

import torch
from torch import Tensor

from .._backend import gpu_kernels, has_module
from . import naive

last_backend: dict[str, str] = {}  # "attn_res_aggregate" -> "triton" | "naive"

__all__ = ["attn_res_aggregate", "fold_score_weight"]


def fold_score_weight(proj_weight: Tensor, norm_weight: Tensor) -> Tensor:
    """The fp32 vector norm_weight ⊙ proj_weight that scores a source: both are weights, so a model folds
    them once at load (`process_weights_after_loading`) rather than at every aggregation.
    proj_weight is the checkpoint `*_res_proj` [1, D] flattened to [D]; norm_weight is `*_res_norm` [D]."""
    if proj_weight.dim() != 1 or proj_weight.shape != norm_weight.shape:
        raise ValueError(
            f"proj_weight and norm_weight must be [D], got {tuple(proj_weight.shape)} and {tuple(norm_weight.shape)}"
        )
    return norm_weight.float() * proj_weight.float()


def attn_res_aggregate(sources: Tensor, score_weight: Tensor, eps: float, norm_weight: Tensor | None = None,
                       norm_eps: float = 0.0, prefix_delta: Tensor | None = None) -> Tensor:
    """sources [S, T, D] (bank snapshots, then the prefix) -> [T, D] in sources.dtype.

    score_j = (V_j / rms(V_j)) · score_weight, softmax over S in fp32, mix = Σ_j p_j V_j; score_weight is
    `fold_score_weight(proj_weight, norm_weight)` [D] fp32. The model's residual updates and norms
    ride along, each costing no launch of its own:
    - prefix_delta [T, D]: first `sources[-1] += prefix_delta` in place (the layer output that the
      running block sum still lacks), rounded to sources.dtype as that add would;
    - norm_weight [D]: returns rms_norm(mix, norm_weight, norm_eps) instead of the mix."""
    if sources.dim() != 3 or sources.shape[0] < 1:
        raise ValueError(f"sources must be [S >= 1, T, D], got {tuple(sources.shape)}")
    if not sources.is_floating_point():
        raise ValueError(f"sources must be floating, got {sources.dtype}")
    hidden = sources.shape[2]
    if score_weight.shape != (hidden,) or score_weight.dtype != torch.float32:
        raise ValueError(f"score_weight must be fp32 [D={hidden}], got {score_weight.dtype} {tuple(score_weight.shape)}")
    if norm_weight is not None and norm_weight.shape != (hidden,):
        raise ValueError(f"norm_weight must be [D={hidden}], got {tuple(norm_weight.shape)}")
    if prefix_delta is not None and prefix_delta.shape != sources.shape[1:]:
        raise ValueError(f"prefix_delta must be [T, D] = {tuple(sources.shape[1:])}, got {tuple(prefix_delta.shape)}")
    if gpu_kernels(sources, score_weight, norm_weight, prefix_delta) and has_module("triton"):
        from . import triton_attn_res

        last_backend["attn_res_aggregate"] = "triton"
        return triton_attn_res.attn_res_aggregate(sources, score_weight, eps, norm_weight, norm_eps, prefix_delta)
    last_backend["attn_res_aggregate"] = "naive"
    return naive.attn_res_aggregate(sources, score_weight, eps, norm_weight, norm_eps, prefix_delta)
