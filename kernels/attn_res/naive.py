"""Plain-torch K3 attention-residual aggregation (K3_MODEL.md §1f), fp32 math."""

from __future__ import annotations

import torch
from torch import Tensor


def attn_res_aggregate(sources: Tensor, score_weight: Tensor, eps: float) -> Tensor:
    """Softmax over sources of a scalar score per token; score_weight [D] fp32 is RMSNorm's weight folded
    into the projection (`fold_score_weight`)."""
    values = sources.float()  # [S, T, D]
    normed = values * torch.rsqrt(values.pow(2).mean(dim=-1, keepdim=True) + eps)  # RMSNorm without weight
    scores = normed @ score_weight  # [S, T]
    probs = scores.softmax(dim=0)  # over sources
    return (probs.unsqueeze(-1) * values).sum(dim=0).to(sources.dtype)  # [T, D]
