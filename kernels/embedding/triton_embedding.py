"""One vocab shard's embedding rows as one Triton launch: a program copies a block of one token's row, or
writes zeros when the id lies outside the shard (read on the device: no host sync, capturable in a CUDA
graph). A pure copy: bit-exact with `naive.py`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._backend import device_of, unit_stride_rows

_BLOCK = 1024


@triton.jit
def _embedding_kernel(weight, token_ids, out, start, S, D, stride_w, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    local = tl.load(token_ids + t).to(tl.int64) - start
    held = (local >= 0) & (local < S)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    row = tl.load(weight + tl.where(held, local, 0) * stride_w + cols, mask=ok & held, other=0.0)
    tl.store(out + t.to(tl.int64) * stride_o + cols, row, mask=ok)


def shard_embedding(weight: Tensor, token_ids: Tensor, start: int, out: Tensor | None) -> Tensor:
    """[T, D] rows of weight [S, D] for token_ids [T] shifted by start; zeros outside [0, S)."""
    T, D = token_ids.shape[0], weight.shape[1]
    if out is None:
        out = torch.empty(T, D, dtype=weight.dtype, device=weight.device)
    if T == 0 or D == 0:
        return out
    weight = unit_stride_rows(weight)
    token_ids = token_ids.contiguous()
    with device_of(weight):
        _embedding_kernel[(T, triton.cdiv(D, _BLOCK))](
            weight, token_ids, out, start, weight.shape[0], D, weight.stride(0), out.stride(0),
            BLOCK=_BLOCK, num_warps=4,
        )
    return out
