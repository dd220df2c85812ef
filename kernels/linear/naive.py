"""Plain-torch linear: x @ weight^T as torch computes it (`F.linear`), or, for an fp32 result from 16-bit
inputs, the exact products summed in fp32 (never rounded to 16 bits, never TF32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, weight: Tensor, out_dtype: torch.dtype, add: Tensor | None = None) -> Tensor:
    if add is not None:  # the fp32 sums plus add, rounded once
        return (linear(x, weight, torch.float32) + add.float()).to(out_dtype)
    if out_dtype == x.dtype:
        return F.linear(x, weight)
    # out_dtype is fp32, x and weight bf16/fp16: their products are exact in fp32
    if x.is_cuda:  # cuBLAS with fp32 output and compute (aten::mm.dtype has no CPU kernel)
        out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x.float(), weight.float())
