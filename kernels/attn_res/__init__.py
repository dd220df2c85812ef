"""K3 attention residuals: each aggregation point mixes the frozen block snapshots ("bank") and the
current block's partial sum ("prefix") with a per-token softmax (K3_MODEL.md §1f)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import naive

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


def attn_res_aggregate(sources: Tensor, score_weight: Tensor, eps: float) -> Tensor:
    """sources [S, T, D] (bank snapshots, then the prefix) -> [T, D] in sources.dtype.

    score_j = (V_j / rms(V_j)) · score_weight, softmax over S in fp32, out = Σ_j p_j V_j; score_weight is
    `fold_score_weight(proj_weight, norm_weight)` [D] fp32."""
    if sources.dim() != 3 or sources.shape[0] < 1:
        raise ValueError(f"sources must be [S >= 1, T, D], got {tuple(sources.shape)}")
    hidden = sources.shape[2]
    if score_weight.shape != (hidden,) or score_weight.dtype != torch.float32:
        raise ValueError(f"score_weight must be fp32 [D={hidden}], got {score_weight.dtype} {tuple(score_weight.shape)}")
    return naive.attn_res_aggregate(sources, score_weight, eps)
