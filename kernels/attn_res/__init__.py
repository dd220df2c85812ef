"""K3 attention residuals: each aggregation point mixes the frozen block snapshots ("bank") and the
current block's partial sum ("prefix") with a per-token softmax (K3_MODEL.md §1f)."""

from __future__ import annotations

from torch import Tensor

from . import naive

__all__ = ["attn_res_aggregate"]


def attn_res_aggregate(sources: Tensor, proj_weight: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """sources [S, T, D] (bank snapshots, then the prefix) -> [T, D] in sources.dtype.

    score_j = (V_j / rms(V_j)) · (norm_weight ⊙ proj_weight), softmax over S in fp32, out = Σ_j p_j V_j.
    proj_weight is the checkpoint `*_res_proj` [1, D] flattened to [D]; norm_weight is `*_res_norm` [D]."""
    if sources.dim() != 3 or sources.shape[0] < 1:
        raise ValueError(f"sources must be [S >= 1, T, D], got {tuple(sources.shape)}")
    hidden = sources.shape[2]
    if proj_weight.shape != (hidden,) or norm_weight.shape != (hidden,):
        raise ValueError(
            f"proj_weight and norm_weight must be [D={hidden}], "
            f"got {tuple(proj_weight.shape)} and {tuple(norm_weight.shape)}"
        )
    return naive.attn_res_aggregate(sources, proj_weight, norm_weight, eps)
