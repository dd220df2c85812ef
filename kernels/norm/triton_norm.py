"""The three normalizations as one Triton kernel launch each (the torch reference takes 5-6: cast,
square, mean, rsqrt, scale, cast back). One program normalizes one row of D in fp32 and writes it back
in x's dtype, so it rounds once at the output like `naive.py`; only the order of the row sum differs.

A single kernel serves all three forms through compile-time flags (mean or sum of squares, optional
weight, optional sigmoid gate), so they cannot drift apart."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._backend import device_of


@triton.jit
def _norm_kernel(x, gate, weight, out, D, eps, stride_x, stride_g, stride_o,
                 MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    xf = tl.load(x + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    sq = tl.sum(xf * xf, axis=0)
    if MEAN:
        sq = sq / D
    y = xf * (1.0 / tl.sqrt(sq + eps))
    if HAS_WEIGHT:
        y = y * tl.load(weight + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_GATE:
        g = tl.load(gate + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
        y = y * (1.0 / (1.0 + tl.exp(-g)))
    tl.store(out + row * stride_o + offs, y.to(out.dtype.element_ty), mask=ok)


def _rows(t: Tensor) -> Tensor:
    """t [..., D] as [N, D] rows with a unit inner stride (a copy only when t is not already so)."""
    return t.reshape(-1, t.shape[-1]) if t.stride(-1) == 1 else t.contiguous().reshape(-1, t.shape[-1])


def _launch(x: Tensor, gate: Tensor | None, weight: Tensor | None, eps: float, mean: bool,
            out_dtype: torch.dtype | None = None) -> Tensor:
    D = x.shape[-1]
    xr = _rows(x)
    gr = _rows(gate) if gate is not None else xr
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    n = xr.shape[0]
    if n == 0:
        return out
    w = weight.contiguous() if weight is not None else xr
    with device_of(x):
        _norm_kernel[(n,)](
            xr, gr, w, out, D, eps, xr.stride(0), gr.stride(0), D,
            MEAN=mean, HAS_WEIGHT=weight is not None, HAS_GATE=gate is not None,
            BLOCK_D=triton.next_power_of_2(D), num_warps=8 if D >= 4096 else 4,
        )
    return out


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    return _launch(x, None, weight, eps, mean=True, out_dtype=out_dtype)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _launch(x, gate, weight, eps, mean=True)


def l2_normalize(x: Tensor, eps: float) -> Tensor:
    return _launch(x, None, None, eps, mean=False)
