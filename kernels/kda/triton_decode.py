"""One KDA decode token per sequence on the slot pool, in Triton (our kernel; fla's fused_recurrent is the anchor).

One program = (sequence n, head h, BV columns of the state). It reads q, k, g of the head whole (K values,
from L2 for all but the first of the head's V/BV programs) and its [K, BV] fp32 state tile once, and writes
the tile back in place:

    q, k <- l2-normalized (optional); S <- diag(exp g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T (scale q)

Why not fla's kernel: it takes contiguous [B, T, H, *] inputs (the layer's q, k, v are strided views of one
projection, so every step paid four copies) and tiles the state by 8 columns with one warp, which leaves the
state stream latency-bound at 16-64 sequences (well above the bytes floor: docs/BENCHMARKS.md).
q, k, v may be any [N, H, D] views with a unit inner stride; padding rows of a fixed-shape batch share the
pad slot (their writes race there and the results are garbage, which nobody reads).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .._backend import device_of

L2_EPS = 1e-6  # kernels/norm/naive.py l2_normalize, the reference's eps


@triton.jit
def _kda_decode_kernel(
    q, k, v, g, beta, state, state_indices, o, scale, H,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_gh, stride_bn, stride_bh,
    stride_sn, stride_sh, stride_on, stride_oh,
    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
):
    n = tl.program_id(0) // H
    h = tl.program_id(0) % H
    offs_k = tl.arange(0, K)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    slot = tl.load(state_indices + n).to(tl.int64)
    tile = state + slot * stride_sn + h * stride_sh + offs_k[:, None] * V + offs_v[None, :]
    s = tl.load(tile)  # first: the state stream is the step's cost; the normalizations below overlap it
    bq = tl.load(q + n * stride_qn + h * stride_qh + offs_k).to(tl.float32)
    bk = tl.load(k + n * stride_kn + h * stride_kh + offs_k).to(tl.float32)
    if L2NORM:
        bq = bq * tl.rsqrt(tl.sum(bq * bq, 0) + EPS)
        bk = bk * tl.rsqrt(tl.sum(bk * bk, 0) + EPS)
    bq = bq * scale
    decay = tl.exp(tl.load(g + n * stride_gn + h * stride_gh + offs_k).to(tl.float32))
    bb = tl.load(beta + n * stride_bn + h * stride_bh).to(tl.float32)
    if BETA_SIGMOID:
        bb = tl.sigmoid(bb)
    bv = tl.load(v + n * stride_vn + h * stride_vh + offs_v).to(tl.float32)
    s = s * decay[:, None]
    u = bb * (bv - tl.sum(bk[:, None] * s, 0))
    s = s + bk[:, None] * u[None, :]
    tl.store(tile, s)
    tl.store(o + n * stride_on + h * stride_oh + offs_v, tl.sum(bq[:, None] * s, 0).to(o.dtype.element_ty))


def supports(q: Tensor, k: Tensor, v: Tensor, g: Tensor, state_pool: Tensor) -> bool:
    """Power-of-2 head sizes >= 16 with unit inner strides, a [S, H, K, V] pool contiguous per slot."""
    K, V = q.shape[-1], v.shape[-1]
    pow2 = all(d >= 16 and d & (d - 1) == 0 for d in (K, V))
    unit = all(t.stride(-1) == 1 for t in (q, k, v, g))
    return pow2 and unit and state_pool.stride()[1:] == (K * V, V, 1)


def default_block_v(N: int, H: int, V: int) -> tuple[int, int]:
    """(BV, num_warps) by the number of (sequence, head) pairs: the winners of `benchmarks/gpu_kda.py`'s
    graph-timed sweep on an H200 (K = V = 128; the timings: docs/BENCHMARKS.md): narrow one-warp tiles spread a
    few heads over more SMs, 64-column four-warp tiles stream the state best from ~400 pairs up."""
    pairs = N * H
    bv, warps = (16, 1) if pairs < 64 else (32, 1) if pairs < 384 else (64, 4)
    return min(bv, V), warps


def kda_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, state_indices: Tensor,
               scale: float | None, use_qk_l2norm_in_kernel: bool, block_v: int | None = None,
               num_warps: int | None = None, beta_sigmoid: bool = False) -> Tensor:
    """q, k, g [N, H, K], v [N, H, V], beta [N, H] (its logits with beta_sigmoid) -> o [N, H, V] in q.dtype;
    the pool advances in place. block_v / num_warps override the tile choice (the benchmark's sweep)."""
    N, H, K = q.shape
    V = v.shape[-1]
    bv, warps = default_block_v(N, H, V)
    bv, warps = block_v or bv, num_warps or warps
    if V % bv:
        raise ValueError(f"block_v={bv} must divide V={V}")
    o = q.new_empty(N, H, V)
    if N == 0:
        return o
    scale = K**-0.5 if scale is None else scale
    with device_of(q):
        _kda_decode_kernel[(N * H, V // bv)](
            q, k, v, g, beta, state_pool, state_indices, o, scale, H,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
            beta.stride(0), beta.stride(1), state_pool.stride(0), state_pool.stride(1), o.stride(0), o.stride(1),
            K=K, V=V, BV=bv, L2NORM=use_qk_l2norm_in_kernel, EPS=L2_EPS, BETA_SIGMOID=beta_sigmoid, num_warps=warps,
        )
    return o
