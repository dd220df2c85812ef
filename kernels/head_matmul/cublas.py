"""Per-head products as one cuBLAS batched GEMM over the heads, with no copies: x [N, H, K] read as its
[H, N, K] view, the result written through the [H, N, M] view of a contiguous [N, H, M] output (cuBLAS takes
the row and batch strides as they are). 16-bit inputs take torch's `out_dtype` GEMM (fp32 accumulation and
output, no widened copies); fp32 ones the plain fp32 GEMM."""

from __future__ import annotations

import torch
from torch import Tensor


def head_matmul(x: Tensor, w: Tensor) -> Tensor:
    out = torch.empty(x.shape[0], x.shape[1], w.shape[2], dtype=torch.float32, device=x.device)
    if x.dtype == torch.float32:
        torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
    else:
        torch.bmm(x.transpose(0, 1), w, out_dtype=torch.float32, out=out.transpose(0, 1))
    return out
