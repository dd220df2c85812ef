"""The embedding lookup of one rank's vocab shard (`model/layers/vocab.py` at TP > 1): the rows of the ids
that this rank holds, zero rows for the ids it does not, so that an all-reduce over the ranks assembles
the whole embedding.

`shard_embedding` checks arguments here, then runs `triton_embedding.py` (one launch) when every tensor is
on CUDA, else the torch reference in `naive.py` (7 launches on a GPU: shift, two compares, or, point the foreign ids
at row 0, gather, zero the foreign rows); `last_backend["shard_embedding"]` records which."""

from __future__ import annotations

from torch import Tensor

from .._backend import gpu_kernels, has_module
from . import naive

last_backend: dict[str, str] = {}  # "shard_embedding" -> "triton" | "naive"

__all__ = ["shard_embedding"]


def shard_embedding(weight: Tensor, token_ids: Tensor, start: int, out: Tensor | None = None) -> Tensor:
    """[T, D] in weight's dtype: row t is weight[token_ids[t] - start] [D] when start <= token_ids[t] <
    start + weight.shape[0], else zeros. weight [S, D] holds vocab rows [start, start + S); token_ids
    integer [T]; written into `out` [T, D] (unit inner stride) when given."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [S, D], got {tuple(weight.shape)}")
    if token_ids.dim() != 1 or token_ids.is_floating_point() or token_ids.is_complex():
        raise ValueError(f"token_ids must be integer [T], got {token_ids.dtype} {tuple(token_ids.shape)}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    shape = (token_ids.shape[0], weight.shape[1])
    if out is not None and (tuple(out.shape) != shape or out.dtype != weight.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {weight.dtype} {shape} with a unit inner stride, got {out.dtype} "
                         f"{tuple(out.shape)} of strides {out.stride()}")
    if gpu_kernels(weight, token_ids, out) and has_module("triton"):
        from . import triton_embedding

        last_backend["shard_embedding"] = "triton"
        return triton_embedding.shard_embedding(weight, token_ids, start, out)
    last_backend["shard_embedding"] = "naive"
    return naive.shard_embedding(weight, token_ids, start, out)
