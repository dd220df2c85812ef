"""The GLU activations (SiTU-GLU, SwiGLU) of the dense MLPs and shared experts as one Triton launch: the torch
reference takes ~8 (casts, two tanh, sigmoid, products, cast back). Elementwise over [rows, I]; gate and
up may be column slices of one stacked projection (any row stride); fp32 math, one rounding at the output,
as `naive.py`. tanh(x) is 2·sigmoid(2x) - 1, as in the routed experts' epilogue (`triton_moe.py`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._backend import device_of, unit_stride_rows

_BLOCK = 1024


@triton.jit
def _glu_kernel(gate, up, out, I, stride_g, stride_u, beta, linear_beta, SITU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gate + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    if SITU:
        capped_g = beta * (2.0 * tl.sigmoid(2.0 * g / beta) - 1.0)
        capped_u = linear_beta * (2.0 * tl.sigmoid(2.0 * u / linear_beta) - 1.0)
        y = capped_g * tl.sigmoid(g) * capped_u
    else:
        y = g * tl.sigmoid(g) * u
    tl.store(out + row * I + cols, y.to(out.dtype.element_ty), mask=ok)


def glu(gate: Tensor, up: Tensor, situ: bool, beta: float = 0.0, linear_beta: float = 0.0) -> Tensor:
    """SiTU-GLU (situ=True, with beta and linear_beta) or SwiGLU of gate, up [..., I], in gate.dtype."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return out
    g, u = unit_stride_rows(gate), unit_stride_rows(up)
    I = g.shape[1]
    with device_of(gate):
        _glu_kernel[(g.shape[0], triton.cdiv(I, _BLOCK))](
            g, u, out, I, g.stride(0), u.stride(0), beta, linear_beta, SITU=situ, BLOCK=_BLOCK, num_warps=4,
        )
    return out
