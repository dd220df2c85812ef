"""The sigmoid gate as one Triton launch: elementwise over [rows, N], fp32 math, one rounding at the output,
as `naive.py` (only sigmoid's last fp32 bits may differ). x and gate are read where they are, any row
stride with a unit inner one (MLA's gate is a column slice of the fused projection of the layer input)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._backend import device_of, unit_stride_rows

_BLOCK = 1024


@triton.jit
def _gate_kernel(x, gate, out, N, stride_x, stride_g, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    xf = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(gate + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + row * N + cols, (xf * tl.sigmoid(g)).to(out.dtype.element_ty), mask=ok)


def sigmoid_gate(x: Tensor, gate: Tensor, out_dtype: torch.dtype) -> Tensor:
    """x * sigmoid(gate) (same shape [..., N]) in out_dtype, contiguous."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.numel() == 0:
        return out
    xr, gr = unit_stride_rows(x), unit_stride_rows(gate)
    N = xr.shape[1]
    with device_of(x):
        _gate_kernel[(xr.shape[0], triton.cdiv(N, _BLOCK))](
            xr, gr, out, N, xr.stride(0), gr.stride(0), BLOCK=_BLOCK, num_warps=4,
        )
    return out
