"""The attention-residual mix as one Triton launch (the torch reference takes ~10: cast, square, mean,
rsqrt, scale, dot, softmax, weighted sum, cast back), optionally with the update of the prefix row that
precedes it and the RMSNorm that follows it in the model (`naive.py` documents the composition).

One program mixes one token: it reads each source row once, scoring it and folding it into an
online softmax (running max, rescaled sum), so the sources are read once whatever S is. All math is
fp32; values round to the sources' dtype where the separate calls would (the updated prefix, the mix),
so the fused norm reads the rounded mix, exactly as the two calls would."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._backend import device_of


@triton.jit
def _fold(acc, denom, best, v, w, D, eps):
    """The online softmax after one more source row v (fp32, masked lanes zero), scored (v / rms(v)) · w."""
    score = tl.sum(v * w, axis=0) / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
    new_best = tl.maximum(best, score)
    rescale = tl.exp(best - new_best)  # 0 for the first row (best = -inf)
    p = tl.exp(score - new_best)
    return acc * rescale + p * v, denom * rescale + p, new_best


@triton.jit
def _attn_res_kernel(src, delta, score_w, norm_w, out, S, D, stride_s, stride_t, stride_sd, stride_dt, stride_dd,
                     eps, norm_eps, HAS_DELTA: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    src_offs = offs * stride_sd  # Triton specializes a unit stride
    w = tl.load(score_w + offs, mask=ok, other=0.0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    denom = tl.full([], 0.0, tl.float32)
    best = tl.full([], -float("inf"), tl.float32)
    row = src + tok * stride_t
    for _ in range(S - 1):  # the bank
        v = tl.load(row + src_offs, mask=ok, other=0.0).to(tl.float32)
        acc, denom, best = _fold(acc, denom, best, v, w, D, eps)
        row += stride_s
    prefix = tl.load(row + src_offs, mask=ok, other=0.0)
    if HAS_DELTA:  # prefix += delta, rounded and stored as the in-place add would
        d = tl.load(delta + tok * stride_dt + offs * stride_dd, mask=ok, other=0.0)
        prefix = (prefix.to(tl.float32) + d.to(tl.float32)).to(src.dtype.element_ty)
        tl.store(row + src_offs, prefix, mask=ok)
    acc, denom, best = _fold(acc, denom, best, prefix.to(tl.float32), w, D, eps)
    mix = (acc / denom).to(out.dtype.element_ty)
    if NORM:
        y = mix.to(tl.float32)
        y = y / tl.sqrt(tl.sum(y * y, axis=0) / D + norm_eps)
        mix = (y * tl.load(norm_w + offs, mask=ok, other=0.0).to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + tok * D + offs, mix, mask=ok)


def attn_res_aggregate(sources: Tensor, score_weight: Tensor, eps: float, norm_weight: Tensor | None = None,
                       norm_eps: float = 0.0, prefix_delta: Tensor | None = None) -> Tensor:
    S, T, D = sources.shape
    out = torch.empty((T, D), dtype=sources.dtype, device=sources.device)
    if T == 0:
        return out
    w = score_weight.contiguous()
    nw = norm_weight.contiguous() if norm_weight is not None else w
    delta = prefix_delta if prefix_delta is not None else w
    delta_strides = prefix_delta.stride() if prefix_delta is not None else (0, 0)
    with device_of(sources):
        _attn_res_kernel[(T,)](
            sources, delta, w, nw, out, S, D, *sources.stride(), *delta_strides, eps, norm_eps,
            HAS_DELTA=prefix_delta is not None, NORM=norm_weight is not None,
            BLOCK_D=triton.next_power_of_2(D), num_warps=16 if D >= 4096 else 4,
        )
    return out
