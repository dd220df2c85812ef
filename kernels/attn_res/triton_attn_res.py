"""The attention-residual mix as one Triton launch (the torch reference takes ~10: cast, square, mean,
rsqrt, scale, dot, softmax, weighted sum, cast back), optionally followed by the RMSNorm that every
mix of the model feeds (`naive.py` documents the composition).

One program mixes one token: it reads each source row once, scoring it and folding it into an
online softmax (running max, rescaled sum), so the sources are read once whatever S is. All math is
fp32; the mix rounds to the output dtype once, and the fused norm reads that rounded mix, exactly as
the two separate calls would."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._backend import device_of


@triton.jit
def _row_score(v, w, D, eps):
    """(v / rms(v)) · w for one fp32 row v (masked lanes zero)."""
    return tl.sum(v * w, axis=0) / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)


@triton.jit
def _attn_res_kernel(src, score_w, norm_w, out, S, D, stride_s, stride_t, eps, norm_eps,
                     NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    w = tl.load(score_w + offs, mask=ok, other=0.0)
    row = src + tok * stride_t
    acc = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)  # source 0 starts the online softmax
    best = _row_score(acc, w, D, eps)
    denom = tl.full([], 1.0, tl.float32)
    for _ in range(1, S):
        row += stride_s
        v = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
        score = _row_score(v, w, D, eps)
        new_best = tl.maximum(best, score)
        rescale = tl.exp(best - new_best)
        p = tl.exp(score - new_best)
        acc = acc * rescale + p * v
        denom = denom * rescale + p
        best = new_best
    mix = (acc / denom).to(out.dtype.element_ty)
    if NORM:
        y = mix.to(tl.float32)
        y = y / tl.sqrt(tl.sum(y * y, axis=0) / D + norm_eps)
        mix = (y * tl.load(norm_w + offs, mask=ok, other=0.0).to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + tok * D + offs, mix, mask=ok)


def attn_res_aggregate(sources: Tensor, score_weight: Tensor, eps: float,
                       norm_weight: Tensor | None = None, norm_eps: float = 0.0) -> Tensor:
    S, T, D = sources.shape
    if sources.stride(2) != 1:
        sources = sources.contiguous()
    out = torch.empty((T, D), dtype=sources.dtype, device=sources.device)
    if T == 0:
        return out
    w = score_weight.contiguous()
    nw = norm_weight.contiguous() if norm_weight is not None else w
    with device_of(sources):
        _attn_res_kernel[(T,)](
            sources, w, nw, out, S, D, sources.stride(0), sources.stride(1), eps, norm_eps,
            NORM=norm_weight is not None, BLOCK_D=triton.next_power_of_2(D), num_warps=16 if D >= 4096 else 4,
        )
    return out
