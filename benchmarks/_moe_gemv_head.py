"""The MoE GEMV pair as it was before the issue-7 rewrite (kernels/moe/triton_gemv.py at b1f133f, its routing
kernel left out: unchanged), verbatim, with its launch from triton_moe.fused_experts: the baseline that
benchmarks/moe_gemv_variants.py times beside the new kernels in the same process. Benchmark-only; deleted
with moe_gemv_variants.py after that run."""

from __future__ import annotations

import triton
import triton.language as tl

from k3serve.kernels.moe.triton_moe import _tanh

_NAN_SCALE = tl.constexpr(255)  # the E8M0 NaN encoding


@triton.jit
def _decode_pair(words, S: tl.constexpr):
    """uint32 words of 8 codes (code i at bits 4i) -> fp32 values of codes S and S + 4, exactly code · 2^-14.

    Both codes sit at the same place in their 16-bit half, so two shifts and one masked merge build both
    fp16 bit patterns (magnitude to bits 9..11, sign to bit 15 of each half)."""
    if 9 - 4 * S >= 0:
        magnitude = words << (9 - 4 * S)
    else:
        magnitude = words >> (4 * S - 9)
    bits = (magnitude & 0x0E000E00) | ((words << (12 - 4 * S)) & 0x80008000)
    low = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _scale_factors(s):
    """E8M0 bytes -> (a, b) fp32 with a · b = 2^(s-127) · 2^14, both normal for every s <= 254; NaN for 255."""
    s = s.to(tl.int32)
    half = s >> 1
    a = ((half + 71) << 23).to(tl.float32, bitcast=True)  # 2^(half - 56)
    b = ((s - half + 70) << 23).to(tl.float32, bitcast=True)  # 2^(s - half - 57)
    return tl.where(s == _NAN_SCALE, float("nan"), a), b


@triton.jit
def _load_tile(word_ptrs, scale_ptrs, n_ok, g_ok):
    """[4, BLOCK_N, G] packed words (16 bytes = one MX group per (column, group)) and the scale factors."""
    ok = n_ok[:, None] & g_ok[None, :]
    words = tl.load(word_ptrs, mask=ok[None, :, :], other=0).to(tl.uint32, bitcast=True)
    a, b = _scale_factors(tl.load(scale_ptrs, mask=ok, other=127))
    return words, a, b


@triton.jit
def _row_dots(words, a, b, x_row, x_offs, CODE_STEP: tl.constexpr):
    """[BLOCK_N, G]: each MX group of the tile dotted with one row of x, times its scale.

    x_row points at the row's first element of this K block; code S of word w pairs with x at
    x_offs[w, g] + S·CODE_STEP, code S + 4 with 4 further on (x as it comes: x_offs = 8w + 32g,
    CODE_STEP 1; h as the up kernel stores it: x_offs = w + 32g, CODE_STEP 8, so the 4 words' x are
    adjacent). The x loads have no mask (a mask costs a register zeroing per value): the caller points
    them at valid memory (see _x_offsets), and masked-off groups have all-zero words. The products keep
    the tile's layout (word index first: Triton puts threads on the last dims, so a group's 16 bytes
    stay in one thread)."""
    part = tl.zeros(words.shape, tl.float32)
    for S in tl.static_range(4):
        low, high = _decode_pair(words, S)
        x_low = tl.load(x_row + x_offs + S * CODE_STEP).to(tl.float32)
        x_high = tl.load(x_row + x_offs + S * CODE_STEP + 4).to(tl.float32)
        part = part + low * x_low[:, None, :]  # two steps: each contracts into one FMA
        part = part + high * x_high[:, None, :]
    return tl.sum(part, axis=0) * a * b


@triton.jit
def _x_offsets(offs, g_ok):
    """offs [4, G] with the groups past the end of K sent back to group 0 of the block: in bounds, and
    their weights are zero."""
    return tl.where(g_ok[None, :], offs, offs % 32)


@triton.jit
def _row_offset(row_index, stride, r_ok, R: tl.constexpr):
    """Offset of row R of the chunk, or of its row 0 (always valid) where R is past the expert's rows:
    that row's sums are computed but never stored. The stride multiplies last, so the compiler sees its
    divisibility (the down kernel's h loads become 16-byte vectors)."""
    pick = tl.arange(0, row_index.shape[0]) == tl.where(tl.sum(tl.where(
        tl.arange(0, row_index.shape[0]) == R, r_ok.to(tl.int32), 0)) > 0, R, 0)
    return tl.sum(tl.where(pick, row_index, 0)) * stride


@triton.jit
def _tile_offsets(e, N, stride_pe, stride_pn, stride_se, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's columns, their mask, and the offsets of the first K block of expert e: words
    [4, BLOCK_N, G] (in int32 words) and scales [BLOCK_N, G]."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_K // 32)
    words = (e * stride_pe + tl.arange(0, 4)[:, None, None] + offs_n[None, :, None] * stride_pn
             + offs_g[None, None, :] * 4)
    scales = e * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :]
    return offs_n, offs_n < N, words, scales


@triton.jit
def _h_column(n):
    """Where the up kernel stores column n of h: within each 32-group, n = 8w + 4·half + S goes to
    8S + 4·half + w, so that the down kernel's x for code S of words 0..3 are 4 adjacent floats."""
    i = n % 32
    return n - i + (i % 4) * 8 + ((i % 8) // 4) * 4 + i // 8


@triton.jit
def _expert_rows(sorted_pairs, expert_starts, expert_counts, active_experts, num_active):
    """(expert, first sorted pair, row count) of this program's active slot; count 0 past num_active."""
    a = tl.program_id(0)
    e = tl.load(active_experts + a).to(tl.int64)
    count = tl.where(a < tl.load(num_active), tl.load(expert_counts + e), 0)
    return e, tl.load(expert_starts + e), count


def configs_up() -> list[triton.Config]:
    """(BLOCK_N, BLOCK_K, ROWS, warps). Threads cover (column, group) pairs, a thread holds
    BLOCK_N·BLOCK_K/32/threads groups per weight: 1 keeps the up kernel at ~80 registers (sm_90, triton
    3.6), 2 (or ROWS 2) at ~165; ROWS 4 spills. ROWS 2 pays when most experts have 2+ rows (T 64 and up).
    One stage: the software pipeliner leaves these loads alone; the K loop prefetches by hand."""
    shapes = [(8, 512, 1, 4), (16, 256, 1, 4), (8, 256, 1, 2), (4, 256, 1, 1), (16, 512, 1, 4), (8, 512, 2, 4),
              (16, 256, 2, 4)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "ROWS": r}, num_warps=w, num_stages=1)
            for n, k, r, w in shapes]


def configs_down() -> list[triton.Config]:
    """As configs_up plus SPLIT_K: with 1-3 experts hit, K shares put more programs on the SMs."""
    shapes = [(8, 512, 1, 4, 2), (16, 256, 1, 4, 2), (8, 256, 1, 2, 4), (4, 256, 1, 1, 2), (16, 512, 1, 4, 1),
              (8, 512, 2, 4, 1), (16, 256, 2, 4, 2)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "ROWS": r, "SPLIT_K": sk}, num_warps=w, num_stages=1)
            for n, k, r, w, sk in shapes]


@triton.autotune(configs=configs_up(), key=["rows_bucket", "I", "D"])
@triton.jit
def gemv_up_kernel(
    x, w1p, w1s, w3p, w3s, h, sorted_pairs, expert_starts, expert_counts, active_experts, num_active,
    top_k, I, D, beta, linear_beta, rows_bucket,
    stride_x, stride_pe, stride_pn, stride_se, stride_sn, stride_h,
    ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
):
    """w1p / w3p: the packed banks as int32 words (strides in words)."""
    e, start, count = _expert_rows(sorted_pairs, expert_starts, expert_counts, active_experts, num_active)
    offs_n, n_ok, words, scales = _tile_offsets(e, I, stride_pe, stride_pn, stride_se, stride_sn, BLOCK_N, BLOCK_K)
    offs_g = tl.arange(0, BLOCK_K // 32)
    x_offs = tl.arange(0, 4)[:, None] * 8 + offs_g[None, :] * 32  # [4, G]: code 0 of each word
    row = tl.arange(0, ROWS)
    for m0 in range(0, count, ROWS):
        r_ok = m0 + row < count
        pair = tl.load(sorted_pairs + start + m0 + row, mask=r_ok, other=0)
        tokens = (pair // top_k).to(tl.int64)
        acc_g = tl.zeros([ROWS, BLOCK_N, BLOCK_K // 32], tl.float32)
        acc_u = tl.zeros([ROWS, BLOCK_N, BLOCK_K // 32], tl.float32)
        w1, a1, b1 = _load_tile(w1p + words, w1s + scales, n_ok, offs_g * 32 < D)
        w3, a3, b3 = _load_tile(w3p + words, w3s + scales, n_ok, offs_g * 32 < D)
        for k0 in range(0, D, BLOCK_K):  # the next block's words are loaded before this one's math
            g_ok = k0 + offs_g * 32 < D  # D % 32 == 0: whole groups in or out
            next_ok = k0 + BLOCK_K + offs_g * 32 < D
            w1_next, a1_next, b1_next = _load_tile(w1p + words + (k0 + BLOCK_K) // 8,
                                                   w1s + scales + (k0 + BLOCK_K) // 32, n_ok, next_ok)
            w3_next, a3_next, b3_next = _load_tile(w3p + words + (k0 + BLOCK_K) // 8,
                                                   w3s + scales + (k0 + BLOCK_K) // 32, n_ok, next_ok)
            x_safe = _x_offsets(x_offs, g_ok)
            for R in tl.static_range(ROWS):
                x_row = x + _row_offset(tokens, stride_x, r_ok, R) + k0
                here = row[:, None, None] == R
                acc_g = tl.where(here, acc_g + _row_dots(w1, a1, b1, x_row, x_safe, 1)[None], acc_g)
                acc_u = tl.where(here, acc_u + _row_dots(w3, a3, b3, x_row, x_safe, 1)[None], acc_u)
            w1, a1, b1 = w1_next, a1_next, b1_next
            w3, a3, b3 = w3_next, a3_next, b3_next
        gate = tl.sum(acc_g, axis=2)
        up = tl.sum(acc_u, axis=2)
        if ACT == 1:  # SiTU-GLU
            act = beta * _tanh(gate / beta) * tl.sigmoid(gate) * (linear_beta * _tanh(up / linear_beta))
        else:  # SwiGLU
            act = gate * tl.sigmoid(gate) * up
        dst = h + (start + m0 + row)[:, None].to(tl.int64) * stride_h + _h_column(offs_n)[None, :]
        tl.store(dst, act.to(h.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


@triton.autotune(configs=configs_down(), key=["rows_bucket", "I", "D"], reset_to_zero=["out"])
@triton.jit
def gemv_down_kernel(
    h, w2p, w2s, out, topk_weights, sorted_pairs, expert_starts, expert_counts, active_experts, num_active,
    top_k, D, I, rows_bucket,
    stride_h, stride_pe, stride_pn, stride_se, stride_sn, stride_out,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """w2p: the packed bank as int32 words (strides in words)."""
    e, start, count = _expert_rows(sorted_pairs, expert_starts, expert_counts, active_experts, num_active)
    offs_n, n_ok, words, scales = _tile_offsets(e, D, stride_pe, stride_pn, stride_se, stride_sn, BLOCK_N, BLOCK_K)
    offs_g = tl.arange(0, BLOCK_K // 32)
    h_offs = tl.arange(0, 4)[:, None] + offs_g[None, :] * 32  # h columns in the up kernel's order
    row = tl.arange(0, ROWS)
    for m0 in range(0, count, ROWS):
        r_ok = m0 + row < count
        pair = tl.load(sorted_pairs + start + m0 + row, mask=r_ok, other=0)
        h_rows = (start + m0 + row).to(tl.int64)
        acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K // 32], tl.float32)
        k_first = tl.program_id(2) * BLOCK_K
        w2, a2, b2 = _load_tile(w2p + words + k_first // 8, w2s + scales + k_first // 32, n_ok,
                                k_first + offs_g * 32 < I)
        for k0 in range(k_first, I, SPLIT_K * BLOCK_K):  # the next block's words come before this one's math
            g_ok = k0 + offs_g * 32 < I
            k_next = k0 + SPLIT_K * BLOCK_K
            w2_next, a2_next, b2_next = _load_tile(w2p + words + k_next // 8, w2s + scales + k_next // 32, n_ok,
                                                   k_next + offs_g * 32 < I)
            h_safe = _x_offsets(h_offs, g_ok)
            for R in tl.static_range(ROWS):
                h_row = h + _row_offset(h_rows, stride_h, r_ok, R) + k0
                here = row[:, None, None] == R
                acc = tl.where(here, acc + _row_dots(w2, a2, b2, h_row, h_safe, 8)[None], acc)
            w2, a2, b2 = w2_next, a2_next, b2_next
        y = tl.sum(acc, axis=2) * tl.load(topk_weights + pair, mask=r_ok, other=0.0)[:, None]
        tok = (pair // top_k).to(tl.int64)
        tl.atomic_add(out + tok[:, None] * stride_out + offs_n[None, :], y, mask=r_ok[:, None] & n_ok[None, :])


def fused_experts(x, weights, topk_weights, topk_ids, act: tuple[int, float, float]):
    """triton_moe.fused_experts' GEMV path before the rewrite (expert_start 0): memset, one-program routing, the
    two kernels on grids of (expert slot, column block[, K share])."""
    import torch

    from k3serve.kernels.moe import triton_moe

    T, D = x.shape
    top_k = topk_ids.shape[1]
    E, I = weights.w1.shape[0], weights.w1.shape[1]
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    pairs, starts, counts, active, num_active = triton_moe.route_small(topk_ids, 0, E)
    h = torch.empty(T * top_k, I, dtype=torch.float32, device=x.device)
    tw = topk_weights.reshape(-1).float().contiguous()
    max_active = min(E, T * top_k)
    p1, p3, p2 = (w.packed.view(torch.int32) for w in (weights.w1, weights.w3, weights.w2))
    s1, s3, s2 = weights.w1.scales, weights.w3.scales, weights.w2.scales
    rows_bucket = min(triton.next_power_of_2(T * top_k), 4096)
    kind, beta, linear_beta = act
    gemv_up_kernel[lambda meta: (max_active, triton.cdiv(I, meta["BLOCK_N"]))](
        x, p1, s1, p3, s3, h, pairs, starts, counts, active, num_active, top_k, I, D, beta, linear_beta,
        rows_bucket, x.stride(0), p1.stride(0), p1.stride(1), s1.stride(0), s1.stride(1), h.stride(0), ACT=kind)
    gemv_down_kernel[lambda meta: (max_active, triton.cdiv(D, meta["BLOCK_N"]), meta["SPLIT_K"])](
        h, p2, s2, out, tw, pairs, starts, counts, active, num_active, top_k, D, I, rows_bucket,
        h.stride(0), p2.stride(0), p2.stride(1), s2.stride(0), s2.stride(1), out.stride(0))
    return out
