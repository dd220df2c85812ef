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
def _norm_kernel(x, gate, weight, out, B, D, eps, stride_xa, stride_xb, stride_ga, stride_gb, stride_oa, stride_ob,
                 MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row = a * B + b of the [A, B, D] views
    a = row // B
    b = row - a * B
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    xf = tl.load(x + a * stride_xa + b * stride_xb + offs, mask=ok, other=0.0).to(tl.float32)
    sq = tl.sum(xf * xf, axis=0)
    if MEAN:
        sq = sq / D
    y = xf * (1.0 / tl.sqrt(sq + eps))
    if HAS_WEIGHT:
        y = y * tl.load(weight + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_GATE:
        g = tl.load(gate + a * stride_ga + b * stride_gb + offs, mask=ok, other=0.0).to(tl.float32)
        y = y * (1.0 / (1.0 + tl.exp(-g)))
    tl.store(out + a * stride_oa + b * stride_ob + offs, y.to(out.dtype.element_ty), mask=ok)


def _rows(t: Tensor, copy: bool = True) -> Tensor:
    """t [..., D] as [A, B, D] with a unit inner stride: the last two leading dims kept apart, so the column
    slices of a fused projection ([T, H, D] views of [T, W] rows) need no copy; a copy only when the dims
    before them do not merge or the inner stride is not 1, and then only with `copy` (an output must be
    written where it is: ValueError instead)."""
    shape = (t.shape[:-2].numel(), t.shape[-2] if t.dim() > 1 else 1, t.shape[-1])
    if t.stride(-1) == 1:
        try:
            return t.view(shape)
        except RuntimeError:
            pass
    if not copy:
        raise ValueError(f"out {tuple(t.shape)} of strides {t.stride()} cannot be viewed as [A, B, D] rows")
    return t.contiguous().view(shape)


def _launch(x: Tensor, gate: Tensor | None, weight: Tensor | None, eps: float, mean: bool,
            out_dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
    """One program a row; `out` (x's shape) may be x itself: a program reads its whole row before it writes."""
    D = x.shape[-1]
    xr = _rows(x)
    gr = _rows(gate) if gate is not None else xr  # gate.shape == x.shape (checked): the same [A, B, D]
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    outr = _rows(out, copy=False)
    n = xr.shape[0] * xr.shape[1]
    if n == 0:
        return out
    w = weight.contiguous() if weight is not None else xr
    with device_of(x):
        _norm_kernel[(n,)](
            xr, gr, w, outr, xr.shape[1], D, eps, xr.stride(0), xr.stride(1), gr.stride(0), gr.stride(1),
            outr.stride(0), outr.stride(1),
            MEAN=mean, HAS_WEIGHT=weight is not None, HAS_GATE=gate is not None,
            BLOCK_D=triton.next_power_of_2(D), num_warps=8 if D >= 4096 else 4,
        )
    return out


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, out_dtype: torch.dtype | None = None,
             out: Tensor | None = None) -> Tensor:
    return _launch(x, None, weight, eps, mean=True, out_dtype=out_dtype, out=out)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _launch(x, gate, weight, eps, mean=True)


def l2_normalize(x: Tensor, eps: float) -> Tensor:
    return _launch(x, None, None, eps, mean=False)
