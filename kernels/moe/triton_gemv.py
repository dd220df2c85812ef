"""MXFP4 (w4a16) routed experts for decode, when each expert has only a few rows: GEMV on the CUDA cores.

A tile = (active expert, BLOCK_N output columns[, a 1/SPLIT_K share of the reduction: down projection]); its
program takes the expert's rows one at a time with fp32 accumulators, streaming the tile's packed weights once
per row. Persistent programs (`programs`) walk the tiles of the experts hit; the grid is known on the host, so
the call is CUDA-graph capturable without a host sync. The up kernel fuses the GLU and writes h [pairs, I] fp32;
the down kernel weights by the top-k weight and adds into out [T, D] fp32 with atomics. The decode of the E2M1
codes and E8M0 scales runs as inline PTX on the GPU (plain Triton in the interpreter). Design:
docs/design/moe_kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3serve.kernels.mxfp4 import MXFP4Tensor

from .._backend import cuda_properties

from .triton_common import tanh

_NAN_SCALE = tl.constexpr(255)  # the E8M0 NaN encoding
PTX = not triton.knobs.runtime.interpret  # inline PTX on the GPU; the interpreter runs plain Triton


_DECODE_PTX = tl.constexpr(
    "{ .reg .b32 t, e, o, p, q; .reg .b16 l, h; shl.b32 t, $8, 3; "
    "lop3.b32 e, $8, t, 0x07070707, 0xE4; lop3.b32 o, $8, t, 0x70707070, 0xE4; "
    "shl.b32 p, e, 9; and.b32 p, p, 0x8E008E00; mov.b32 {l, h}, p; cvt.f32.f16 $0, l; cvt.f32.f16 $4, h; "
    "shl.b32 p, o, 5; and.b32 p, p, 0x8E008E00; mov.b32 {l, h}, p; cvt.f32.f16 $1, l; cvt.f32.f16 $5, h; "
    "shl.b32 p, e, 1; and.b32 p, p, 0x8E008E00; mov.b32 {l, h}, p; cvt.f32.f16 $2, l; cvt.f32.f16 $6, h; "
    "shr.b32 p, $8, 3; and.b32 p, p, 0x0E000E00; and.b32 q, $8, 0x80008000; or.b32 p, p, q; "
    "mov.b32 {l, h}, p; cvt.f32.f16 $3, l; cvt.f32.f16 $7, h; }")


@triton.jit
def _halves(bits):
    """The two fp16 halves of uint32 bits as fp32."""
    low = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_word(words, PTX: tl.constexpr):
    """uint32 words of 8 codes (code i at bits 4i) -> 8 fp32 tensors, code i exactly code · 2^-14.

    An fp16 pair (codes i and i+4, one per half) needs the magnitude bits at 9..11 and the sign at 15 of each
    half. With t = words << 3, e = (words & 0x07070707) | (t & ~0x07070707) holds the even codes' magnitudes at
    bits 0..2 of each byte and their signs at bit 6, o = (words & 0x70707070) | (t & ~0x70707070) the odd
    codes' magnitudes at bits 4..6 and their signs at bit 2 of the byte above; the other bits of e and o fall
    outside the mask after each pair's shift. 12 integer ops a word, one lop3 per e and o on the GPU; code 7's
    sign would leave o's top byte, so codes 3 and 7 come from the word itself."""
    if PTX:
        return tl.inline_asm_elementwise(_DECODE_PTX, "=f,=f,=f,=f,=f,=f,=f,=f,r", [words],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    t = words << 3
    e = (words & 0x07070707) | (t & 0xF8F8F8F8)
    o = (words & 0x70707070) | (t & 0x8F8F8F8F)
    c0, c4 = _halves((e << 9) & 0x8E008E00)
    c1, c5 = _halves((o << 5) & 0x8E008E00)
    c2, c6 = _halves((e << 1) & 0x8E008E00)
    c3, c7 = _halves(((words >> 3) & 0x0E000E00) | (words & 0x80008000))
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _load_bytes(ptrs, PTX: tl.constexpr):
    """uint8 at ptrs (valid addresses) as int32."""
    if PTX:
        return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=True,
                                         pack=1)
    return tl.load(ptrs).to(tl.int32)


@triton.jit
def _scale_factors(s):
    """E8M0 bytes (int32) -> (a, b) fp32 with a · b = 2^(s-127) · 2^14, both normal for every s <= 254; NaN for
    255."""
    half = s >> 1
    a = ((half + 71) << 23).to(tl.float32, bitcast=True)  # 2^(half - 56)
    b = ((s - half + 70) << 23).to(tl.float32, bitcast=True)  # 2^(s - half - 57)
    return tl.where(s == _NAN_SCALE, float("nan"), a), b


_BF16X8_PTX = tl.constexpr(
    "{ .reg .b32 a, b, c, d; ld.global.nc.v4.b32 {a, b, c, d}, [$8]; shl.b32 $0, a, 16; and.b32 $1, a, 0xFFFF0000; "
    "shl.b32 $2, b, 16; and.b32 $3, b, 0xFFFF0000; shl.b32 $4, c, 16; and.b32 $5, c, 0xFFFF0000; "
    "shl.b32 $6, d, 16; and.b32 $7, d, 0xFFFF0000; }")
_F32X8_PTX = tl.constexpr(
    "{ ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$8]; ld.global.nc.v4.b32 {$4, $5, $6, $7}, [$8+16]; }")


@triton.jit
def _load_x8(ptrs, PTX: tl.constexpr):
    """The 8 activations at ptrs + 0..7 (bf16 or fp32; ptrs 16-byte aligned) as 8 fp32 tensors shaped like ptrs:
    x_i meets code i of the word (`_decode_word`)."""
    if PTX:
        if ptrs.dtype.element_ty == tl.bfloat16:
            x0, x1, x2, x3, x4, x5, x6, x7 = tl.inline_asm_elementwise(
                _BF16X8_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,l", [ptrs], dtype=(tl.int32,) * 8, is_pure=True, pack=1)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = tl.inline_asm_elementwise(
                _F32X8_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,l", [ptrs], dtype=(tl.int32,) * 8, is_pure=True, pack=1)
        return (x0.to(tl.float32, bitcast=True), x1.to(tl.float32, bitcast=True), x2.to(tl.float32, bitcast=True),
                x3.to(tl.float32, bitcast=True), x4.to(tl.float32, bitcast=True), x5.to(tl.float32, bitcast=True),
                x6.to(tl.float32, bitcast=True), x7.to(tl.float32, bitcast=True))
    return (tl.load(ptrs).to(tl.float32), tl.load(ptrs + 1).to(tl.float32), tl.load(ptrs + 2).to(tl.float32),
            tl.load(ptrs + 3).to(tl.float32), tl.load(ptrs + 4).to(tl.float32), tl.load(ptrs + 5).to(tl.float32),
            tl.load(ptrs + 6).to(tl.float32), tl.load(ptrs + 7).to(tl.float32))


@triton.jit
def _group_dots(words, x8, PTX: tl.constexpr):
    """[G, BLOCK_N]: each MX group of the tile dotted with one row of x (x8: the row's x per code position of a
    word, each [4, G]), not yet scaled. Each product is added on its own (it contracts into one FMA)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _decode_word(words, PTX)
    x0, x1, x2, x3, x4, x5, x6, x7 = x8
    part = c0 * x0[:, :, None]
    part = part + c1 * x1[:, :, None]
    part = part + c2 * x2[:, :, None]
    part = part + c3 * x3[:, :, None]
    part = part + c4 * x4[:, :, None]
    part = part + c5 * x5[:, :, None]
    part = part + c6 * x6[:, :, None]
    part = part + c7 * x7[:, :, None]
    return tl.sum(part, axis=0)


@triton.jit
def _tile(tile, n_blocks, N, expert_starts, expert_counts, active_experts, stride_pe, stride_pn, stride_se,
          stride_sn, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """Tile `tile` (active slot tile // n_blocks, column block tile % n_blocks): its expert's first sorted pair
    and row count, its columns and their mask, and the offsets of its first K block: words [4, G, BLOCK_N] (in
    int32 words) and scales [G, BLOCK_N] (of a valid column: past N, column N - 1)."""
    e = tl.load(active_experts + tile // n_blocks).to(tl.int64)
    offs_n = (tile % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, G)
    words = (e * stride_pe + tl.arange(0, 4)[:, None, None] + offs_g[None, :, None] * 4
             + offs_n[None, None, :] * stride_pn)
    scales = e * stride_se + offs_g[:, None] + tl.minimum(offs_n, N - 1)[None, :] * stride_sn
    return tl.load(expert_starts + e), tl.load(expert_counts + e), offs_n, offs_n < N, words, scales


@triton.jit
def _load_block(word_ptrs, scale_ptrs, k0, K, n_ok, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PTX: tl.constexpr):
    """Words and E8M0 scale bytes of the K block at k0 (word_ptrs, scale_ptrs: of the tile's first block), raw:
    a prefetch holds them in registers until the block's turn. Without EVEN_K, groups past K load zero words
    and the scale of the column's group 0 (finite unless the column is NaN anyway); k0 itself is always a
    block inside K (the caller clamps its prefetch)."""
    G: tl.constexpr = scale_ptrs.shape[0]
    if EVEN_K:
        scale_at = scale_ptrs + k0 // 32
        if EVEN_N:
            words = tl.load(word_ptrs + k0 // 8)
        else:
            words = tl.load(word_ptrs + k0 // 8, mask=n_ok[None, None, :], other=0)
    else:
        g_ok = k0 + tl.arange(0, G) * 32 < K
        scale_at = scale_ptrs + tl.where(g_ok, k0 // 32, -tl.arange(0, G))[:, None]
        words = tl.load(word_ptrs + k0 // 8, mask=g_ok[None, :, None] & n_ok[None, None, :], other=0)
    return words.to(tl.uint32, bitcast=True), _load_bytes(scale_at, PTX)


@triton.jit
def _x_block(x_ptrs, k0, K, EVEN_K: tl.constexpr):
    """x_ptrs [4, G] (word w of group g of the first K block) moved to the block at k0; groups past K read
    group 0 of the block (in bounds; their words are zero)."""
    if EVEN_K:
        return x_ptrs + k0
    g_ok = k0 + tl.arange(0, x_ptrs.shape[1]) * 32 < K
    return x_ptrs + tl.where(g_ok, k0, k0 - tl.arange(0, x_ptrs.shape[1]) * 32)[None, :]


@triton.jit
def route_kernel(topk_ids, num_pairs, expert_start, num_local, sorted_pairs, expert_starts, expert_counts,
                 active_experts, num_active, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """triton_moe.route in one program (decode: at most a few thousand pairs), the same outputs: a
    histogram counts the pairs per local expert, a sort of (expert, pair) keys groups them stably,
    prefix sums give the starts and the active list (experts with pairs first, then the rest, each in
    expert order)."""
    p = tl.arange(0, BLOCK_P)
    key = tl.load(topk_ids + p, mask=p < num_pairs, other=-1).to(tl.int32) - expert_start
    key = tl.where((key >= 0) & (key < num_local) & (p < num_pairs), key, num_local)  # num_local: elsewhere
    counts = tl.histogram(key, BLOCK_E)
    order = tl.sort(key * BLOCK_P + p)
    tl.store(sorted_pairs + p, order % BLOCK_P, mask=p < num_pairs)
    e = tl.arange(0, BLOCK_E)
    local = e < num_local
    tl.store(expert_counts + e, counts, mask=local)
    tl.store(expert_starts + e, tl.cumsum(counts, 0) - counts, mask=local)
    hit = (counts > 0) & local
    idle = (counts == 0) & local
    active = tl.sum(hit.to(tl.int32))
    slot = tl.where(hit, tl.cumsum(hit.to(tl.int32), 0) - 1, active + tl.cumsum(idle.to(tl.int32), 0) - 1)
    tl.store(active_experts + slot, e, mask=local)
    tl.store(num_active, active)


def configs_up() -> list[triton.Config]:
    """(BLOCK_N, warps, PREFETCH, programs per SM), BLOCK_K 512: the tiles that won, or came close, at some T of
    1-16 on an H200, of a sweep whose other shapes lost at every T (benchmarks/results/h200-2026-12-01/
    moe_variants.log, docs/BENCHMARKS.md). A warp's lanes cover 16 groups and 2 columns, its warps more columns,
    and a thread repeats the rest (C = BLOCK_N / (2 warps): 1 to 4), sharing its x over them. PREFETCH 2 keeps
    twice the bytes in flight for a few more instructions (register moves). Programs per SM = how many fit
    (registers, sm_90, triton 3.6; benchmarks/moe_gemv_sass.py checks it): a persistent grid must not wait for a
    second wave."""
    shapes = [(4, 1, 2, 12), (4, 2, 1, 14), (8, 2, 1, 8), (8, 2, 2, 6), (16, 4, 1, 4)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": 512, "PREFETCH": pf, "PROGRAMS_PER_SM": p}, num_warps=w,
                          num_stages=1) for n, w, pf, p in shapes]


def configs_down() -> list[triton.Config]:
    """As configs_up plus SPLIT_K (after PREFETCH): K shares put more tiles on the SMs when few experts are hit.
    8 columns on one warp won at every T (split in 2 at 1-2 tokens, whole from 4); the best of the others was 10%
    (T 1) to 25% (T 16) slower."""
    shapes = [(8, 1, 1, 1, 12), (8, 1, 1, 2, 12)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": 512, "PREFETCH": pf, "SPLIT_K": sk, "PROGRAMS_PER_SM": p},
                          num_warps=w, num_stages=1) for n, w, pf, sk, p in shapes]


_EVEN = {"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
         "EVEN_N": lambda args: args["N"] % args["BLOCK_N"] == 0}


@triton.autotune(configs=configs_up(), key=["rows_bucket", "N", "K"])
@triton.heuristics(_EVEN)
@triton.jit
def gemv_up_kernel(
    x, w1p, w1s, w3p, w3s, h, out, sorted_pairs, expert_starts, expert_counts, active_experts, num_active,
    top_k, N, K, beta, linear_beta, rows_bucket, out_numel,
    stride_x, stride_pe, stride_pn, stride_se, stride_sn, stride_h,
    ACT: tl.constexpr, PTX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    """h[pair, :N] = act(x[token] W1[e]^T, x[token] W3[e]^T); w1p / w3p: the packed banks as int32 words (strides
    in words), K = D the latent width. Also zeroes out (out_numel fp32), which the down kernel adds into: one
    memset launch less. PROGRAMS_PER_SM sizes the grid only (see `programs`)."""
    for z in range(tl.program_id(0) * 1024, out_numel, tl.num_programs(0) * 1024):
        tl.store(out + z + tl.arange(0, 1024), 0.0, mask=z + tl.arange(0, 1024) < out_numel)
    n_blocks = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tl.load(num_active) * n_blocks, tl.num_programs(0)):
        start, count, offs_n, n_ok, words, scales = _tile(tile, n_blocks, N, expert_starts, expert_counts,
                                                          active_experts, stride_pe, stride_pn, stride_se,
                                                          stride_sn, BLOCK_N, BLOCK_K // 32)
        # the expert's rows; range(start, start + count) compiles to 143 registers, not 128 (sm_90): 7 programs an SM
        for m in range(0, count):
            _up_row(x, w1p + words, w1s + scales, w3p + words, w3s + scales, h, sorted_pairs, top_k, K, beta,
                    linear_beta, stride_x, stride_h, offs_n, n_ok, start + m, ACT, PTX, BLOCK_K, PREFETCH, EVEN_K,
                    EVEN_N)


@triton.jit
def _up_row(x, w1_words, w1_scales, w3_words, w3_scales, h, sorted_pairs, top_k, K, beta, linear_beta, stride_x,
            stride_h, offs_n, n_ok, row, ACT: tl.constexpr, PTX: tl.constexpr, BLOCK_K: tl.constexpr,
            PREFETCH: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """h[row] (row: a sorted pair of the tile's expert) at the tile's columns, streaming the tile's weights once
    (w*_words, w*_scales: pointers into its first K block)."""
    G: tl.constexpr = BLOCK_K // 32
    last = tl.cdiv(K, BLOCK_K) * BLOCK_K - BLOCK_K  # the last K block
    x_offs = tl.arange(0, 4)[:, None] * 8 + tl.arange(0, G)[None, :] * 32  # [4, G]: the x of each word's code 0
    token = (tl.load(sorted_pairs + row) // top_k).to(tl.int64)
    x_row = x + token * stride_x  # the stride multiplies last: the compiler sees its divisibility
    acc_g = tl.zeros([G, offs_n.shape[0]], tl.float32)
    acc_u = tl.zeros([G, offs_n.shape[0]], tl.float32)
    w1, s1 = _load_block(w1_words, w1_scales, 0, K, n_ok, EVEN_K, EVEN_N, PTX)
    w3, s3 = _load_block(w3_words, w3_scales, 0, K, n_ok, EVEN_K, EVEN_N, PTX)
    if PREFETCH == 2:
        w1_b, s1_b = _load_block(w1_words, w1_scales, tl.minimum(BLOCK_K, last), K, n_ok, EVEN_K, EVEN_N, PTX)
        w3_b, s3_b = _load_block(w3_words, w3_scales, tl.minimum(BLOCK_K, last), K, n_ok, EVEN_K, EVEN_N, PTX)
    for k0 in range(0, K, BLOCK_K):  # the blocks PREFETCH ahead are loaded before this one's math
        k_ahead = tl.minimum(k0 + PREFETCH * BLOCK_K, last)  # past the end: the last block again (cached)
        w1_c, s1_c = _load_block(w1_words, w1_scales, k_ahead, K, n_ok, EVEN_K, EVEN_N, PTX)
        w3_c, s3_c = _load_block(w3_words, w3_scales, k_ahead, K, n_ok, EVEN_K, EVEN_N, PTX)
        a1, b1 = _scale_factors(s1)
        a3, b3 = _scale_factors(s3)
        x8 = _load_x8(_x_block(x_row + x_offs, k0, K, EVEN_K), PTX)
        acc_g += _group_dots(w1, x8, PTX) * a1 * b1
        acc_u += _group_dots(w3, x8, PTX) * a3 * b3
        if PREFETCH == 2:
            w1, s1, w3, s3, w1_b, s1_b, w3_b, s3_b = w1_b, s1_b, w3_b, s3_b, w1_c, s1_c, w3_c, s3_c
        else:
            w1, s1, w3, s3 = w1_c, s1_c, w3_c, s3_c
    gate = tl.sum(acc_g, axis=0)
    up = tl.sum(acc_u, axis=0)
    if ACT == 1:  # SiTU-GLU
        act = beta * tanh(gate / beta) * tl.sigmoid(gate) * (linear_beta * tanh(up / linear_beta))
    else:  # SwiGLU
        act = gate * tl.sigmoid(gate) * up
    tl.store(h + row.to(tl.int64) * stride_h + offs_n, act.to(h.dtype.element_ty), mask=n_ok)


@triton.autotune(configs=configs_down(), key=["rows_bucket", "N", "K"], reset_to_zero=["out"])
@triton.heuristics(_EVEN)
@triton.jit
def gemv_down_kernel(
    h, w2p, w2s, out, topk_weights, sorted_pairs, expert_starts, expert_counts, active_experts, num_active,
    top_k, N, K, rows_bucket,
    stride_h, stride_pe, stride_pn, stride_se, stride_sn, stride_out,
    PTX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    """out[token, :N] += topk_weight[pair] · h[pair] W2[e]^T; w2p: the packed bank as int32 words (strides in
    words), N = D, K = I. A tile is (active slot, column block, K share)."""
    n_blocks = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tl.load(num_active) * n_blocks * SPLIT_K, tl.num_programs(0)):
        start, count, offs_n, n_ok, words, scales = _tile(tile // SPLIT_K, n_blocks, N, expert_starts,
                                                          expert_counts, active_experts, stride_pe, stride_pn,
                                                          stride_se, stride_sn, BLOCK_N, BLOCK_K // 32)
        share = tile % SPLIT_K
        blocks = tl.cdiv(K, BLOCK_K)  # the share's last block; a share past K has none (its loop is empty)
        last = tl.minimum(share + tl.maximum(blocks - 1 - share, 0) // SPLIT_K * SPLIT_K, blocks - 1) * BLOCK_K
        for m in range(0, count):  # the expert's rows
            _down_row(h, w2p + words, w2s + scales, out, topk_weights, sorted_pairs, top_k, K, share * BLOCK_K, last,
                      stride_h, stride_out, offs_n, n_ok, start + m, PTX, BLOCK_K, SPLIT_K, PREFETCH, EVEN_K, EVEN_N)


@triton.jit
def _down_row(h, w2_words, w2_scales, out, topk_weights, sorted_pairs, top_k, K, k_first, last, stride_h,
              stride_out, offs_n, n_ok, row, PTX: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
              PREFETCH: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """Adds the tile's share (K blocks k_first, k_first + SPLIT_K * BLOCK_K, .. <= last) of h[row] (row: a sorted
    pair of the tile's expert), weighted, into out at the tile's columns, streaming the share's weights once."""
    G: tl.constexpr = BLOCK_K // 32
    h_offs = tl.arange(0, 4)[:, None] * 8 + tl.arange(0, G)[None, :] * 32
    h_row = h + row.to(tl.int64) * stride_h
    acc = tl.zeros([G, offs_n.shape[0]], tl.float32)
    w2, s2 = _load_block(w2_words, w2_scales, tl.minimum(k_first, last), K, n_ok, EVEN_K, EVEN_N, PTX)
    if PREFETCH == 2:
        w2_b, s2_b = _load_block(w2_words, w2_scales, tl.minimum(k_first + SPLIT_K * BLOCK_K, last), K, n_ok, EVEN_K,
                                 EVEN_N, PTX)
    for k0 in range(k_first, K, SPLIT_K * BLOCK_K):  # the blocks PREFETCH ahead come before this one's math
        k_ahead = tl.minimum(k0 + PREFETCH * SPLIT_K * BLOCK_K, last)
        w2_c, s2_c = _load_block(w2_words, w2_scales, k_ahead, K, n_ok, EVEN_K, EVEN_N, PTX)
        a2, b2 = _scale_factors(s2)
        x8 = _load_x8(_x_block(h_row + h_offs, k0, K, EVEN_K), PTX)
        acc += _group_dots(w2, x8, PTX) * a2 * b2
        if PREFETCH == 2:
            w2, s2, w2_b, s2_b = w2_b, s2_b, w2_c, s2_c
        else:
            w2, s2 = w2_c, s2_c
    pair = tl.load(sorted_pairs + row)
    y = tl.sum(acc, axis=0) * tl.load(topk_weights + pair)
    tl.atomic_add(out + (pair // top_k).to(tl.int64) * stride_out + offs_n, y, mask=n_ok)


def programs(device: torch.device, tiles: int, per_sm: int) -> int:
    """Grid of a persistent kernel: per_sm programs per SM (an interpreter run: 3, so programs take several
    tiles), never more than the tiles there can be."""
    slots = per_sm * cuda_properties(device).multi_processor_count if device.type == "cuda" else 3
    return max(1, min(tiles, slots))


def experts(x: Tensor, w1: MXFP4Tensor, w3: MXFP4Tensor, w2: MXFP4Tensor, h: Tensor, out: Tensor,
            topk_weights: Tensor, routing: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], top_k: int,
            act: tuple[int, float, float], rows_bucket: int) -> None:
    """Launch the up and down kernels (the caller, triton_moe.fused_experts, has routed and allocated):
    x [T, D] bf16, MXFP4 w1/w3 [E, I, D] and w2 [E, D, I], h fp32 [T*k, I], out fp32 [T, D] contiguous (its
    content does not matter: the up kernel zeroes it), topk_weights fp32 [T*k], routing as triton_moe.route
    returns it, act = (ACT, beta, linear_beta). The PTX x loads are 16-byte vectors of bf16 or fp32, so an
    x of another dtype, or one that starts off a 16-byte boundary, runs the plain Triton path."""
    pairs, starts, counts, active, num_active = routing
    kind, beta, linear_beta = act
    E, I, D = w1.shape[0], w1.shape[1], w1.shape[2]
    max_active = min(E, pairs.numel())
    ptx = (PTX and x.dtype in (torch.bfloat16, torch.float32) and x.data_ptr() % 16 == 0
           and (x.shape[0] == 1 or x.stride(0) % 8 == 0))
    p1, p3, p2 = (w.packed.view(torch.int32) for w in (w1, w3, w2))  # 8 codes a word; raises if misaligned
    s1, s3, s2 = w1.scales, w3.scales, w2.scales
    up_grid = lambda meta: (programs(x.device, max_active * triton.cdiv(I, meta["BLOCK_N"]),  # noqa: E731
                                     meta["PROGRAMS_PER_SM"]),)
    down_grid = lambda meta: (programs(x.device, max_active * triton.cdiv(D, meta["BLOCK_N"])  # noqa: E731
                                       * meta["SPLIT_K"], meta["PROGRAMS_PER_SM"]),)
    gemv_up_kernel[up_grid](
        x, p1, s1, p3, s3, h, out, pairs, starts, counts, active, num_active, top_k, I, D, beta, linear_beta,
        rows_bucket, out.numel(), x.stride(0), p1.stride(0), p1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
        ACT=kind, PTX=ptx,
    )
    gemv_down_kernel[down_grid](
        h, p2, s2, out, topk_weights, pairs, starts, counts, active, num_active, top_k, D, I, rows_bucket,
        h.stride(0), p2.stride(0), p2.stride(1), s2.stride(0), s2.stride(1), out.stride(0), PTX=ptx,
    )
