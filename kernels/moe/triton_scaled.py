"""MXFP4 routed experts on Blackwell's block-scaled tensor cores (sm_100, sm_103): `tl.dot_scaled` of the
checkpoint's e2m1 weights and E8M0 scales, as stored, with activations split in registers into two MXFP8 terms
(e4m3, an E8M0 scale per 32: the value and its residual), which Triton lowers to `tcgen05.mma ...
kind::mxf8f6f4.block_scale`. The two terms carry a bf16 activation to about 2^-8, as bf16 does itself.

    up kernel:   h[pair] = act(x[tok] W1[e]^T, x[tok] W3[e]^T)     bf16, GLU fused in the epilogue
    down kernel: out[tok] += topk_weight[pair] · h[pair] W2[e]^T    fp32 atomics (weighting and top-k sum fused)

Operands are swapped: the MMA's M is 128 rows of the expert's weights, its N the two terms of a tile of BLOCK_T
token rows, so a decode batch fills a tile of 16. A bf16 operand would make Triton upcast the e2m1 weights
(kind::f16), hence the MXFP8 terms. Triton's interpreter has no dot_scaled: there `_mx_dot` runs the same product
in plain Triton. Routing and the grid are `triton_moe`'s (no host sync). Design: docs/design/moe_blackwell_fp4.md.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from k3serve.kernels.mxfp4 import MXFP4Tensor

from .triton_common import tanh

ROWS = 128  # weight rows a program: the M of the block-scaled MMA (64 would make Triton upcast instead)
NATIVE = not triton.knobs.runtime.interpret  # dot_scaled on the GPU; its plain-Triton product in the interpreter


def _configs(max_block_t: int) -> list[triton.Config]:
    """Token tiles tried once per (rows bucket, I, D), BLOCK_K = 128 (4 MX groups a step). The accumulator
    [rows, 2 * BLOCK_T] lives in tensor memory (512 fp32 columns of 128 lanes): the up kernel's 256 rows allow
    BLOCK_T 64 (with 128, Triton 3.6 emits no MMA at all), the down kernel's 128 rows BLOCK_T 128."""
    shapes = [(16, 4), (32, 4), (64, 4), (64, 8), (128, 8)]
    return [triton.Config({"BLOCK_T": t, "BLOCK_K": 128}, num_warps=w, num_stages=3)
            for t, w in shapes if t <= max_block_t]


@triton.jit
def _pow2(e):
    """2^e exactly as fp32 for int32 e in [-127, 127] (a product of two normal floats; 2^-127 is subnormal)."""
    half = e >> 1
    return ((half + 127) << 23).to(tl.float32, bitcast=True) * ((e - half + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp8(x):
    """x [T, K] float -> (e4m3 codes uint8 [T, K], E8M0 uint8 [T, K/32]): per 32 contiguous elements the scale
    2^(s-127), s the least for which amax <= 448 · 2^(s-127) (no element saturates; an all-zero group gets s = 0),
    each element x · 2^(127-s) rounded to nearest even, in integer ops (the same bits on the GPU and in the
    interpreter, whose fp8 casts do not round to even); non-finite elements give NaN (0x7F).
    `kernels/moe/naive.round_to_mxfp8` is its reference."""
    T: tl.constexpr = x.shape[0]
    K: tl.constexpr = x.shape[1]
    v = x.to(tl.float32).reshape(T, K // 32, 32)
    bits = tl.max(tl.abs(v), axis=2).to(tl.int32, bitcast=True)
    s = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # 448 = 1.75 · 2^8, mantissa 0x600000
    s = tl.minimum(tl.maximum(s, 0), 254)
    q = tl.abs(v) * _pow2(127 - s)[:, :, None]  # in [0, 448]
    b = q.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - 960  # exponent and 3 mantissa bits, e4m3's bias 7
    subnormal = ((q * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # below 2^-6: m · 2^-9, m = 0..8
    code = tl.where(q < 0.015625, subnormal, normal)
    code = tl.where((b >> 23) < 255, code, 0x7F) | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)  # inf, NaN: NaN
    return code.reshape(T, K).to(tl.uint8), s.to(tl.uint8)


@triton.jit
def _e8m0(s):
    """E8M0 bytes -> 2^(s-127) fp32 (255: NaN)."""
    s = s.to(tl.int32)
    return tl.where(s == 255, float("nan"), _pow2(s - 127))


@triton.jit
def _minifloat(code, EXPONENT: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """Sign-magnitude minifloat codes (int32: the sign above EXPONENT exponent and MANTISSA mantissa bits) -> fp32,
    exactly (e2m1: 2, 1, 1; e4m3: 4, 3, 7; no NaN handling)."""
    e = (code >> MANTISSA) & ((1 << EXPONENT) - 1)
    m = code & ((1 << MANTISSA) - 1)
    mag = (m + tl.where(e == 0, 0, 1 << MANTISSA)).to(tl.float32) * _pow2(tl.maximum(e, 1) - BIAS - MANTISSA)
    return tl.where(((code >> (EXPONENT + MANTISSA)) & 1) == 1, -mag, mag)


@triton.jit
def _mxfp8_value(codes, scales):
    """e4m3 codes uint8 [T, K] and E8M0 scales uint8 [T, K/32] -> their fp32 values [T, K], exactly."""
    T: tl.constexpr = codes.shape[0]
    K: tl.constexpr = codes.shape[1]
    c = codes.to(tl.int32)
    v = tl.where((c & 0x7F) == 0x7F, float("nan"), _minifloat(c, 4, 3, 7))
    return (v.reshape(T, K // 32, 32) * _e8m0(scales)[:, :, None]).reshape(T, K)


@triton.jit
def _mxfp8_pair(x):
    """x [T, K] float -> (e4m3 codes uint8 [2T, K], E8M0 uint8 [2T, K/32]): rows 0..T-1 are `_mxfp8(x)`, rows
    T..2T-1 `_mxfp8` of its residual (exact in fp32), so the two rows of a token add up to x to about 2^-8."""
    T: tl.constexpr = x.shape[0]
    K: tl.constexpr = x.shape[1]
    hi, hi_scale = _mxfp8(x)
    lo, lo_scale = _mxfp8(x.to(tl.float32) - _mxfp8_value(hi, hi_scale))
    codes = tl.join(hi, lo).permute(2, 0, 1).reshape(2 * T, K)
    return codes, tl.join(hi_scale, lo_scale).permute(2, 0, 1).reshape(2 * T, K // 32)


@triton.jit
def _mx_dot(w, w_scale, xq, x_scale, acc, NATIVE: tl.constexpr):
    """acc + W X^T: w uint8 [N, K/2] e2m1 pairs (element 2i in the low nibble), w_scale uint8 [N, K/32], xq e4m3
    codes uint8 [T, K], x_scale uint8 [T, K/32] -> fp32 [N, T]. The interpreter's product decodes both exactly to
    fp32 (dot_scaled's documented semantics) and multiplies in fp32."""
    if NATIVE:
        return tl.dot_scaled(w, w_scale, "e2m1", tl.trans(xq), x_scale, "e4m3", acc)
    N: tl.constexpr = w.shape[0]
    K: tl.constexpr = w.shape[1] * 2
    pairs = w.to(tl.int32)
    wf = _minifloat(tl.join(pairs & 0xF, pairs >> 4).reshape(N, K), 2, 1, 1)
    wf = (wf.reshape(N, K // 32, 32) * _e8m0(w_scale)[:, :, None]).reshape(N, K)
    return tl.dot(wf, tl.trans(_mxfp8_value(xq, x_scale)), acc, input_precision="ieee")


@triton.autotune(configs=_configs(64), key=["rows_bucket", "I", "D"])
@triton.jit
def scaled_up_kernel(
    x, w1p, w1s, w3p, w3s, h, sorted_pairs, expert_starts, expert_counts, active_experts, num_active,
    top_k, I, D, beta, linear_beta, rows_bucket,
    stride_x, stride_pe, stride_pn, stride_se, stride_sn, stride_h,
    ACT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE: tl.constexpr,
):
    """Program (active slot, 128 rows of I): both projections of the rows for each token tile, the GLU, h bf16.
    The gate and up rows stack into one [256, K] operand: one MMA (two of M = 128) a K step on one quantized x."""
    a = tl.program_id(0)
    if a >= tl.load(num_active):
        return
    e = tl.load(active_experts + a).to(tl.int64)
    start = tl.load(expert_starts + e)
    count = tl.load(expert_counts + e)
    n0 = tl.program_id(1) * 128
    offs_n = n0 + tl.arange(0, 128)
    stack = tl.arange(0, 256)  # 0..127: gate rows n0.., 128..255: up rows n0..
    is_gate = (stack < 128)[:, None]
    offs_k = tl.arange(0, BLOCK_K)
    row = n0 + stack % 128
    w_at = e * stride_pe + row[:, None] * stride_pn + tl.arange(0, BLOCK_K // 2)[None, :]
    s_at = e * stride_se + row[:, None] * stride_sn + tl.arange(0, BLOCK_K // 32)[None, :]
    w_ptrs = tl.where(is_gate, w1p + w_at, w3p + w_at)
    s_ptrs = tl.where(is_gate, w1s + s_at, w3s + s_at)
    for m0 in range(0, count, BLOCK_T):
        rows = m0 + tl.arange(0, BLOCK_T)
        r_ok = rows < count
        tok = (tl.load(sorted_pairs + start + rows, mask=r_ok, other=0) // top_k).to(tl.int64)
        acc = tl.zeros([256, 2 * BLOCK_T], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            xq, xs = _mxfp8_pair(tl.load(x + tok[:, None] * stride_x + k0 + offs_k[None, :], mask=r_ok[:, None],
                                         other=0.0))
            acc = _mx_dot(tl.load(w_ptrs + k0 // 2), tl.load(s_ptrs + k0 // 32), xq, xs, acc, NATIVE)
        gate, up = tl.sum(acc.reshape(2, 128, 2, BLOCK_T), axis=2).permute(1, 2, 0).split()
        if ACT == 1:  # SiTU-GLU
            act = beta * tanh(gate / beta) * tl.sigmoid(gate) * (linear_beta * tanh(up / linear_beta))
        else:  # SwiGLU
            act = gate * tl.sigmoid(gate) * up
        dst = h + (start + rows)[None, :].to(tl.int64) * stride_h + offs_n[:, None]
        tl.store(dst, act.to(h.dtype.element_ty), mask=r_ok[None, :])


@triton.autotune(configs=_configs(128), key=["rows_bucket", "I", "D"], reset_to_zero=["out"])
@triton.jit
def scaled_down_kernel(
    h, w2p, w2s, out, topk_weights, sorted_pairs, expert_starts, expert_counts, active_experts, num_active,
    top_k, D, I, rows_bucket,
    stride_h, stride_pe, stride_pn, stride_se, stride_sn, stride_out,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE: tl.constexpr,
):
    """Program (active slot, 128 rows of D): h W2^T of the expert's rows, weighted, added into out."""
    a = tl.program_id(0)
    if a >= tl.load(num_active):
        return
    e = tl.load(active_experts + a).to(tl.int64)
    start = tl.load(expert_starts + e)
    count = tl.load(expert_counts + e)
    offs_n = tl.program_id(1) * 128 + tl.arange(0, 128)
    offs_k = tl.arange(0, BLOCK_K)
    w_at = e * stride_pe + offs_n[:, None] * stride_pn + tl.arange(0, BLOCK_K // 2)[None, :]
    s_at = e * stride_se + offs_n[:, None] * stride_sn + tl.arange(0, BLOCK_K // 32)[None, :]
    for m0 in range(0, count, BLOCK_T):
        rows = m0 + tl.arange(0, BLOCK_T)
        r_ok = rows < count
        pair = tl.load(sorted_pairs + start + rows, mask=r_ok, other=0)
        src = h + (start + rows)[:, None].to(tl.int64) * stride_h
        acc = tl.zeros([128, 2 * BLOCK_T], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            hq, hs = _mxfp8_pair(tl.load(src + k0 + offs_k[None, :], mask=r_ok[:, None], other=0.0))
            acc = _mx_dot(tl.load(w2p + w_at + k0 // 2), tl.load(w2s + s_at + k0 // 32), hq, hs, acc, NATIVE)
        acc = tl.sum(acc.reshape(128, 2, BLOCK_T), axis=1) * tl.load(topk_weights + pair, mask=r_ok, other=0.0)[None, :]
        tok = (pair // top_k).to(tl.int64)
        tl.atomic_add(out + tok[None, :] * stride_out + offs_n[:, None], acc, mask=r_ok[None, :])


def supports(w1: MXFP4Tensor, w2: MXFP4Tensor) -> bool:
    """Whole 128-row tiles of I and D (the kernels have no row masks), so the K step of 128 divides both too."""
    I, D = w1.shape[1], w1.shape[2]
    return I % ROWS == 0 and D % ROWS == 0 and w2.shape[1] == D


def experts(x: Tensor, w1: MXFP4Tensor, w3: MXFP4Tensor, w2: MXFP4Tensor, h: Tensor, out: Tensor,
            topk_weights: Tensor, routing: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], top_k: int,
            act: tuple[int, float, float], rows_bucket: int) -> None:
    """Launch the up and down kernels (the caller, triton_moe.fused_experts, has routed and allocated): x [T, D]
    bf16, MXFP4 w1/w3 [E, I, D] and w2 [E, D, I], h bf16 [T*k, I], out fp32 [T, D] zeroed, topk_weights fp32
    [T*k], routing as triton_moe.route returns it, act = (ACT, beta, linear_beta)."""
    pairs = routing[0]
    kind, beta, linear_beta = act
    E, I, D = w1.shape
    max_active = min(E, pairs.numel())
    p1, s1, p3, s3, p2, s2 = w1.packed, w1.scales, w3.packed, w3.scales, w2.packed, w2.scales
    scaled_up_kernel[(max_active, I // ROWS)](
        x, p1, s1, p3, s3, h, *routing, top_k, I, D, beta, linear_beta, rows_bucket,
        x.stride(0), p1.stride(0), p1.stride(1), s1.stride(0), s1.stride(1), h.stride(0), ACT=kind, NATIVE=NATIVE)
    scaled_down_kernel[(max_active, D // ROWS)](
        h, p2, s2, out, topk_weights, *routing, top_k, D, I, rows_bucket,
        h.stride(0), p2.stride(0), p2.stride(1), s2.stride(0), s2.stride(1), out.stride(0), NATIVE=NATIVE)
