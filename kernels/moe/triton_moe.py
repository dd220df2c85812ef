"""MXFP4 (w4a16) routed experts in Triton: two grouped GEMMs over the local experts that have tokens (prefill).

    up kernel:   h[pair] = act(x[tok] W1[e]^T, x[tok] W3[e]^T)     bf16, GLU fused in the epilogue
    down kernel: out[tok] += topk_weight[pair] · h[pair] W2[e]^T    fp32 atomics (weighting and top-k sum fused)

Weights stay packed and are upcast in registers; routing (`route`, `route_small`) takes no host sync.
`fused_experts` picks this pair, the GEMV pair (`triton_gemv.py`) or the Gluon MMA pair (`gluon_mma.py`) by the
host-known T, and on sm_100 / sm_103 the block-scaled pair (`triton_scaled.py`); `last_path` says which. Design:
docs/design/moe_kernels.md, docs/design/moe_blackwell_fp4.md.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._backend import cuda_capability, device_of
from .triton_common import tanh

ACT_SILU, ACT_SITU = 0, 1


@triton.jit
def _upcast(packed_ptrs, scale_ptrs, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, n_ok, dtype: tl.constexpr):
    """[BLOCK_N, BLOCK_K/2] packed bytes + [BLOCK_N, BLOCK_K/32] scales -> [BLOCK_N, BLOCK_K] weights in dtype."""
    p = tl.load(packed_ptrs, mask=n_ok[:, None], other=0)
    lo = ((p & 0x08) << 4) | ((p & 0x07) << 2)
    hi = (p & 0x80) | ((p & 0x70) >> 2)
    codes = tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K)  # element 2i from the low nibble
    w = codes.to(tl.float8e4nv, bitcast=True).to(dtype)  # exactly e2m1 * 2^-6
    s = tl.load(scale_ptrs, mask=n_ok[:, None], other=121).to(tl.int16)
    scale = ((s + 6) << 7).to(tl.bfloat16, bitcast=True).to(dtype)  # 2^(s - 127 + 6)
    w = w.reshape(BLOCK_N, BLOCK_K // 32, 32) * scale[:, :, None]
    return w.reshape(BLOCK_N, BLOCK_K)


def _configs() -> list[triton.Config]:
    """Tile shapes tried once per (rows bucket, I, D); the first is the plain default."""
    shapes = [(32, 128, 4, 3), (32, 256, 4, 3), (16, 256, 4, 4), (16, 512, 4, 3), (64, 256, 8, 3), (32, 64, 4, 4)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st) for n, k, w, st in shapes]


def _prune(configs, named_args, **_):
    """Keep the tiles whose BLOCK_K divides both reduction dims (the kernels have no K tail)."""
    dims = (named_args["I"], named_args["D"])
    return [c for c in configs if all(d % c.kwargs["BLOCK_K"] == 0 for d in dims)]


@triton.autotune(configs=_configs(), key=["rows_bucket", "I", "D"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _up_kernel(
    x, w1p, w1s, w3p, w3s, h, sorted_pairs, expert_starts, expert_counts, active_experts, num_active,
    top_k, I, D, beta, linear_beta, rows_bucket,
    stride_x, stride_pe, stride_pn, stride_se, stride_sn, stride_h,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    a = tl.program_id(0)
    if a >= tl.load(num_active):
        return
    e = tl.load(active_experts + a).to(tl.int64)
    start = tl.load(expert_starts + e)
    count = tl.load(expert_counts + e)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    offs_kp = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 32)
    w_row = e * stride_pe + offs_n[:, None] * stride_pn
    s_row = e * stride_se + offs_n[:, None] * stride_sn
    for m0 in range(0, count, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        r_ok = rows < count
        pair = tl.load(sorted_pairs + start + rows, mask=r_ok, other=0)
        tok = (pair // top_k).to(tl.int64)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            xk = tl.load(x + tok[:, None] * stride_x + k0 + offs_k[None, :], mask=r_ok[:, None], other=0.0)
            wg = _upcast(w1p + w_row + k0 // 2 + offs_kp[None, :], w1s + s_row + k0 // 32 + offs_ks[None, :],
                         BLOCK_N, BLOCK_K, n_ok, xk.dtype)
            acc_g = tl.dot(xk, tl.trans(wg), acc_g)
            wu = _upcast(w3p + w_row + k0 // 2 + offs_kp[None, :], w3s + s_row + k0 // 32 + offs_ks[None, :],
                         BLOCK_N, BLOCK_K, n_ok, xk.dtype)
            acc_u = tl.dot(xk, tl.trans(wu), acc_u)
        if ACT == 1:  # SiTU-GLU
            act = beta * tanh(acc_g / beta) * tl.sigmoid(acc_g) * (linear_beta * tanh(acc_u / linear_beta))
        else:  # SwiGLU
            act = acc_g * tl.sigmoid(acc_g) * acc_u
        dst = h + (start + rows)[:, None].to(tl.int64) * stride_h + offs_n[None, :]
        tl.store(dst, act.to(h.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


@triton.autotune(configs=_configs(), key=["rows_bucket", "I", "D"], prune_configs_by={"early_config_prune": _prune},
                 reset_to_zero=["out"])
@triton.jit
def _down_kernel(
    h, w2p, w2s, out, topk_weights, sorted_pairs, expert_starts, expert_counts, active_experts, num_active,
    top_k, D, I, rows_bucket,
    stride_h, stride_pe, stride_pn, stride_se, stride_sn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    a = tl.program_id(0)
    if a >= tl.load(num_active):
        return
    e = tl.load(active_experts + a).to(tl.int64)
    start = tl.load(expert_starts + e)
    count = tl.load(expert_counts + e)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    offs_kp = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 32)
    w_row = e * stride_pe + offs_n[:, None] * stride_pn
    s_row = e * stride_se + offs_n[:, None] * stride_sn
    for m0 in range(0, count, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        r_ok = rows < count
        pair = tl.load(sorted_pairs + start + rows, mask=r_ok, other=0)
        src = h + (start + rows)[:, None].to(tl.int64) * stride_h
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            hk = tl.load(src + k0 + offs_k[None, :], mask=r_ok[:, None], other=0.0)
            w = _upcast(w2p + w_row + k0 // 2 + offs_kp[None, :], w2s + s_row + k0 // 32 + offs_ks[None, :],
                        BLOCK_N, BLOCK_K, n_ok, hk.dtype)
            acc = tl.dot(hk, tl.trans(w), acc)
        acc = acc * tl.load(topk_weights + pair, mask=r_ok, other=0.0)[:, None]
        tok = (pair // top_k).to(tl.int64)
        tl.atomic_add(out + tok[:, None] * stride_out + offs_n[None, :], acc, mask=r_ok[:, None] & n_ok[None, :])


def activation_kind(activation) -> tuple[int, float, float] | None:
    """(ACT, beta, linear_beta) for the GLUs the kernel fuses, None for any other callable."""
    from . import silu_glu, situ_glu

    if activation is silu_glu:
        return ACT_SILU, 0.0, 0.0
    if isinstance(activation, functools.partial) and activation.func is situ_glu and not activation.args:
        kw = activation.keywords
        if set(kw) == {"beta", "linear_beta"}:
            return ACT_SITU, float(kw["beta"]), float(kw["linear_beta"])
    return None


def supports(x: Tensor, weights, activation) -> bool:
    """bf16 activations, MXFP4 banks with unit inner strides (row shards are fine), a fused GLU."""
    w1, w3, w2 = weights.w1, weights.w3, weights.w2
    I, D = w1.shape[1], w1.shape[2]
    strides_ok = (w1.packed.stride() == w3.packed.stride() and w1.scales.stride() == w3.scales.stride()
                  and all(t.stride(-1) == 1 for w in (w1, w3, w2) for t in (w.packed, w.scales)))
    return (x.dtype == torch.bfloat16 and I % 64 == 0 and D % 64 == 0 and strides_ok
            and activation_kind(activation) is not None)


def route(topk_ids: Tensor, expert_start: int, num_local: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(sorted_pairs [T*k] int32, starts [E], counts [E], active_experts [E] int32, num_active [1]), all on device.

    Pairs (t*k + j) of local experts come first, grouped by expert; active_experts lists the experts with
    tokens first, num_active counts them."""
    key = topk_ids.reshape(-1).to(torch.int32) - expert_start
    key = torch.where((key >= 0) & (key < num_local), key, num_local)
    order = torch.sort(key, stable=True).indices.to(torch.int32)
    ones = torch.ones_like(key)
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=key.device).scatter_add_(0, key.long(), ones)
    counts = counts[:num_local]  # scatter_add, not bincount: bincount syncs to size its output
    starts = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).to(torch.int32)
    active = torch.argsort((counts == 0).to(torch.int8), stable=True).to(torch.int32)
    num_active = (counts > 0).sum(dtype=torch.int32).reshape(1)
    return order, starts, counts, active, num_active


def route_small(topk_ids: Tensor, expert_start: int, num_local: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`route` as one Triton program (triton_gemv.route_kernel) for decode-sized T * k: one launch in
    place of ~20 small torch kernels, which cost more than the expert GEMVs themselves at T = 1."""
    from .triton_gemv import route_kernel

    ids = topk_ids.reshape(-1)
    num_pairs, dev = ids.numel(), ids.device
    if not 1 <= num_pairs <= ROUTE_SMALL_MAX_PAIRS:  # one program holds (and sorts) every pair
        raise ValueError(f"route_small takes 1..{ROUTE_SMALL_MAX_PAIRS} (token, expert) pairs, got {num_pairs}")
    pairs = torch.empty(num_pairs, dtype=torch.int32, device=dev)
    starts, counts, active = (torch.empty(num_local, dtype=torch.int32, device=dev) for _ in range(3))
    num_active = torch.empty(1, dtype=torch.int32, device=dev)
    with device_of(ids):
        route_kernel[(1,)](ids.contiguous(), num_pairs, expert_start, num_local, pairs, starts, counts, active,
                           num_active, BLOCK_P=triton.next_power_of_2(num_pairs),
                           BLOCK_E=triton.next_power_of_2(num_local + 1), num_warps=4)
    return pairs, starts, counts, active, num_active


GEMV_MAX_TOKENS = 8  # tokens up to here: the GEMV kernels (measured: docs/BENCHMARKS.md)
MMA_MAX_TOKENS = 192  # then up to here the Gluon MMA kernels (gluon_mma.py); past it (prefill) the tensor-core pair
ROUTE_SMALL_MAX_PAIRS = 1024  # T * top_k up to here: routing in one program (decode, either kernel pair)
SCALED_MAJOR = 10  # sm_100 / sm_103 (B200, GB300): tcgen05 block-scaled MMAs, the "scaled" pair (sm_12x has none)

PATHS = ("gemv", "mma", "dot", "scaled")
last_path: str | None = None  # one of PATHS: which pair of kernels the last fused_experts call ran


def kernel_pair(num_tokens: int, device: torch.device) -> str:
    """The pair `fused_experts` runs for `num_tokens` tokens on `device` when not told: "scaled" on a CUDA device
    of compute capability SCALED_MAJOR.x, else `upcast_pair` (CPU tensors, the interpreter, too)."""
    if device.type == "cuda" and cuda_capability(device)[0] == SCALED_MAJOR:
        return "scaled"
    return upcast_pair(num_tokens)


def upcast_pair(num_tokens: int) -> str:
    """The pair that upcasts the weights for `num_tokens` tokens (Hopper; a shape "scaled" does not tile)."""
    return "gemv" if num_tokens <= GEMV_MAX_TOKENS else "mma" if num_tokens <= MMA_MAX_TOKENS else "dot"


def fused_experts(x: Tensor, weights, topk_weights: Tensor, topk_ids: Tensor, activation, expert_start: int,
                  path: str | None = None) -> Tensor:
    """x [T, D] bf16, MXFP4 w1/w3 [E, I, D], w2 [E, D, I] -> fp32 [T, D] (this rank's partial sum).

    path None picks by `kernel_pair`: on sm_100 / sm_103 "scaled" (triton_scaled.py, block-scaled MMAs on two MXFP8
    terms of the activations); before Blackwell by the host-known T "gemv" (triton_gemv.py, CUDA cores) while T <=
    GEMV_MAX_TOKENS, then "mma" (gluon_mma.py, tensor cores, weights read once per 8 rows) while T <=
    MMA_MAX_TOKENS, else "dot" (the tensor-core kernels above, for prefill). The thresholds' measurements:
    docs/BENCHMARKS.md. "scaled" on shapes it does not tile runs `upcast_pair` instead."""
    global last_path
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be None or one of {PATHS}, got {path!r}")
    act, beta, linear_beta = activation_kind(activation)
    T, D = x.shape
    top_k = topk_ids.shape[1]
    w1, w3, w2 = weights.w1, weights.w3, weights.w2
    E, I = w1.shape[0], w1.shape[1]
    if path is None:
        path = kernel_pair(T, x.device)
    if path == "scaled":
        from . import triton_scaled

        if not triton_scaled.supports(w1, w2):
            path = upcast_pair(T)
    if path == "mma":
        try:
            from . import gluon_mma
        except ImportError:  # a triton without Gluon's Ampere MMA (before 3.5): the tensor-core pair instead
            gluon_mma = None
        path = "mma" if gluon_mma is not None and gluon_mma.supports(x, w1, w2) else "dot"
    last_path = path
    x = x.contiguous()
    if T * top_k == 0:
        return torch.zeros(T, D, dtype=torch.float32, device=x.device)
    empty_or_zeros = torch.empty if path == "gemv" else torch.zeros  # the GEMV up kernel zeroes out itself
    out = empty_or_zeros(T, D, dtype=torch.float32, device=x.device)
    small = T * top_k <= ROUTE_SMALL_MAX_PAIRS
    pairs, starts, counts, active, num_active = (route_small if small else route)(topk_ids, expert_start, E)
    h_dtype = torch.float32 if path == "gemv" else x.dtype  # CUDA cores read fp32 without a conversion
    h = torch.empty(T * top_k, I, dtype=h_dtype, device=x.device)
    tw = topk_weights.reshape(-1).float().contiguous()
    rows_bucket = min(triton.next_power_of_2(T * top_k), 4096)  # autotune key: decode and prefill differ
    routing = (pairs, starts, counts, active, num_active)
    if path == "gemv":
        from .triton_gemv import experts

        with device_of(x):
            experts(x, w1, w3, w2, h, out, tw, routing, top_k, (act, beta, linear_beta), rows_bucket)
        return out
    if path == "mma":
        with device_of(x):
            gluon_mma.experts(x, w1, w3, w2, h, out, tw, routing, top_k, (act, beta, linear_beta))
        return out
    if path == "scaled":
        with device_of(x):
            triton_scaled.experts(x, w1, w3, w2, h, out, tw, routing, top_k, (act, beta, linear_beta), rows_bucket)
        return out
    max_active = min(E, T * top_k)
    p1, s1, p3, s3, p2, s2 = w1.packed, w1.scales, w3.packed, w3.scales, w2.packed, w2.scales
    up_grid = lambda meta: (max_active, triton.cdiv(I, meta["BLOCK_N"]))  # noqa: E731
    down_grid = lambda meta: (max_active, triton.cdiv(D, meta["BLOCK_N"]))  # noqa: E731
    with device_of(x):
        _up_kernel[up_grid](
            x, p1, s1, p3, s3, h, *routing, top_k, I, D, beta, linear_beta,
            rows_bucket, x.stride(0), p1.stride(0), p1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
            ACT=act, BLOCK_M=16,
        )
        _down_kernel[down_grid](
            h, p2, s2, out, tw, *routing, top_k, D, I, rows_bucket,
            h.stride(0), p2.stride(0), p2.stride(1), s2.stride(0), s2.stride(1), out.stride(0), BLOCK_M=16,
        )
    return out
