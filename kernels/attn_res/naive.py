"""Plain-torch K3 attention-residual aggregation (model/K3_MODEL.md §1f), fp32 math."""

from __future__ import annotations

import torch
from torch import Tensor

from ..norm import naive as norm_naive


def attn_res_aggregate(sources: Tensor, score_weight: Tensor, eps: float, norm_weight: Tensor | None = None,
                       norm_eps: float = 0.0, prefix_delta: Tensor | None = None) -> Tensor:
    """Softmax over sources of a scalar score per token; score_weight [D] fp32 is RMSNorm's weight folded
    into the projection (`fold_score_weight`). prefix_delta is first added to the last source in place.
    With norm_weight, the mix (rounded to sources.dtype) then goes through `rms_norm(mix, norm_weight,
    norm_eps)`, the norm each of the model's mixes feeds."""
    if prefix_delta is not None:
        sources[-1].add_(prefix_delta)
    # one source: itself, as a new tensor (a view would change with the next in-place prefix update)
    mix = sources[0].clone() if sources.shape[0] == 1 else _mix(sources, score_weight, eps)
    return mix if norm_weight is None else norm_naive.rms_norm(mix, norm_weight, norm_eps)


def _mix(sources: Tensor, score_weight: Tensor, eps: float) -> Tensor:
    values = sources.float()  # [S, T, D]
    normed = values * torch.rsqrt(values.pow(2).mean(dim=-1, keepdim=True) + eps)  # RMSNorm without weight
    scores = normed @ score_weight  # [S, T]
    probs = scores.softmax(dim=0)  # over sources
    return (probs.unsqueeze(-1) * values).sum(dim=0).to(sources.dtype)  # [T, D]
