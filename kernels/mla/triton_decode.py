"""Absorbed MLA decode over the paged latent cache in Triton (split-KV, natural-log LSE), and the LSE merge.

One program = (sequence n, KV split s, group of BLOCK_H heads). It walks its split's pages one block
(block_size tokens) at a time: scores [BLOCK_H, block] = q_latent·c + q_pe·k_pe, an online softmax in
base 2, acc += p·c. All heads of a group share each page load (MQA), so the cache is read once per
head group. Splits write (o, lse) partials that `_merge_kernel` combines (parallel over heads and
64-column slices, parts in chunks of 16); with one split the first kernel writes the output directly.

    kv_cache [num_blocks, block_size, L + R] -> row = [ c (L) | k_pe (R) ], V = c
    o_part   [N, H, S, L] fp32, lse_part [N, H, S] fp32 (natural log; -inf for an empty split)

Tokens past seq_len in the last page are masked at load (their rows may hold anything, poison too)
and pages past the sequence are never read, so unused block-table entries may be -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._backend import cuda_properties, device_of
from . import split_rule
from .split_rule import block_h, head_groups, split_plan

LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634
DTYPES = (torch.bfloat16, torch.float16)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def supports(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor) -> bool:
    """Cache in bf16/fp16 (queries are cast to it), power-of-2 L, R and block size, each >= 16 (the
    smallest tl.dot operand), unit inner strides."""
    L, R, block_size = q_latent.shape[-1], q_pe.shape[-1], kv_cache.shape[1]
    unit = all(t.stride(-1) == 1 for t in (q_latent, q_pe, kv_cache))
    shapes = all(_pow2(d) and d >= 16 for d in (L, R, block_size)) and unit
    return kv_cache.dtype in DTYPES and shapes and q_latent.shape[0] > 0


@triton.jit
def _decode_kernel(
    q_latent, q_pe, kv_cache, block_tables, seq_lens, o_part, lse_part, o_out, lse_out,
    scale_log2, H, pages_per_split,
    stride_qn, stride_qh, stride_pn, stride_ph, stride_cb, stride_ct, stride_btn,
    stride_on, stride_oh, stride_os, stride_ln, stride_lh,
    L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, DIRECT: tl.constexpr,
):
    n = tl.program_id(0)
    split = tl.program_id(1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    offs_t = tl.arange(0, PAGE)

    seq_len = tl.load(seq_lens + n)
    num_pages = tl.cdiv(seq_len, PAGE)
    p_begin = split * pages_per_split
    p_end = tl.minimum(p_begin + pages_per_split, num_pages)

    q = tl.load(q_latent + n * stride_qn + heads[:, None] * stride_qh + offs_l[None, :], mask=h_ok[:, None], other=0.0)
    qp = tl.load(q_pe + n * stride_pn + heads[:, None] * stride_ph + offs_r[None, :], mask=h_ok[:, None], other=0.0)
    q, qp = q.to(kv_cache.dtype.element_ty), qp.to(kv_cache.dtype.element_ty)  # the queries round to the cache dtype

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L], tl.float32)
    for p in range(p_begin, p_end):
        block = tl.load(block_tables + n * stride_btn + p).to(tl.int64)
        t_ok = p * PAGE + offs_t < seq_len
        rows = kv_cache + block * stride_cb + offs_t[:, None] * stride_ct
        c = tl.load(rows + offs_l[None, :], mask=t_ok[:, None], other=0.0)  # [PAGE, L]
        k_pe = tl.load(rows + L + offs_r[None, :], mask=t_ok[:, None], other=0.0)  # [PAGE, R]
        s = tl.dot(q, tl.trans(c)) + tl.dot(qp, tl.trans(k_pe))  # [BLOCK_H, PAGE]
        s = tl.where(t_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c)
        m_i = m_new

    has = l_i > 0
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if DIRECT:
        tl.store(o_out + n * stride_on + heads[:, None] * stride_oh + offs_l[None, :],
                 o.to(o_out.dtype.element_ty), mask=h_ok[:, None])
        tl.store(lse_out + n * stride_ln + heads * stride_lh, lse, mask=h_ok)
    else:
        tl.store(o_part + n * stride_on + heads[:, None] * stride_oh + split * stride_os + offs_l[None, :], o,
                 mask=h_ok[:, None])
        tl.store(lse_part + (n * H + heads) * tl.num_programs(1) + split, lse, mask=h_ok)


@triton.jit
def _parts_tile(o_parts, p0, P, tile_offs, d_ok, stride_op, CHUNK_P: tl.constexpr):
    """Parts p0 .. p0 + CHUNK_P - 1 of the program's columns, fp32. Masked by the part count only (not by the
    weights), so the load waits on nothing and is in flight with the LSE loads."""
    chunk = p0 + tl.arange(0, CHUNK_P)
    return tl.load(o_parts + chunk[:, None] * stride_op + tile_offs[None, :], mask=(chunk < P)[:, None] & d_ok[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _add_parts(o, tile, lse_row, p0, P, shift, inv_total, stride_lp, CHUNK_P: tl.constexpr):
    """o + the tile's parts weighted by exp(lse_p - lse); parts of weight 0 (lse -inf: their outputs may hold
    anything, NaN too) are dropped, not multiplied."""
    chunk = p0 + tl.arange(0, CHUNK_P)
    coef = tl.exp(tl.load(lse_row + chunk * stride_lp, mask=chunk < P, other=float("-inf")) - shift) * inv_total
    return o + tl.sum(tl.where(coef[:, None] > 0, coef[:, None] * tile, 0.0), 0)


@triton.jit
def _merge_kernel(
    o_parts, lse_parts, o_out, lse_out, P, H, D,
    stride_op, stride_on, stride_oh, stride_lp, stride_ln, stride_lh,
    stride_out_n, stride_out_h,
    BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK_P: tl.constexpr,
):
    """One program per (n, h, BLOCK_D columns): lse = logsumexp_p lse_p; o = Σ_p exp(lse_p - lse) o_p.
    The first CHUNK_P parts are loaded before the LSE reduction (at 16 splits, all of them): one memory round trip,
    not two."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    lse_row = lse_parts + n * stride_ln + h * stride_lh
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    tile_offs = n * stride_on + h * stride_oh + offs_d
    first = _parts_tile(o_parts, 0, P, tile_offs, d_ok, stride_op, CHUNK_P)
    parts = tl.arange(0, BLOCK_P)
    lse = tl.load(lse_row + parts * stride_lp, mask=parts < P, other=float("-inf"))
    m = tl.max(lse, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse - shift), 0)  # -inf parts add 0
    inv_total = 1.0 / tl.where(total > 0, total, 1.0)
    o = _add_parts(tl.zeros([BLOCK_D], tl.float32), first, lse_row, 0, P, shift, inv_total, stride_lp, CHUNK_P)
    for p0 in range(CHUNK_P, P, CHUNK_P):
        tile = _parts_tile(o_parts, p0, P, tile_offs, d_ok, stride_op, CHUNK_P)
        o = _add_parts(o, tile, lse_row, p0, P, shift, inv_total, stride_lp, CHUNK_P)
    tl.store(o_out + n * stride_out_n + h * stride_out_h + offs_d, o.to(o_out.dtype.element_ty), mask=d_ok)
    if tl.program_id(2) == 0:
        tl.store(lse_out + n * H + h, shift + tl.log(total))


def _merge(o_parts: Tensor, lse_parts: Tensor, part_strides: tuple[int, int, int],
           lse_strides: tuple[int, int, int], P: int, o: Tensor, lse: Tensor) -> None:
    """o [N, H, D], lse [N, H] (contiguous) from P parts addressed by (part, n, h) strides."""
    N, H, D = o.shape
    BLOCK_D = 64
    _merge_kernel[(N, H, triton.cdiv(D, BLOCK_D))](
        o_parts, lse_parts, o, lse, P, H, D, *part_strides, *lse_strides, o.stride(0), o.stride(1),
        BLOCK_D=BLOCK_D, BLOCK_P=triton.next_power_of_2(P), CHUNK_P=min(16, triton.next_power_of_2(P)),
    )


def num_sm(device: torch.device) -> int:
    return cuda_properties(device).multi_processor_count if device.type == "cuda" else 4


def shared_per_block(device: torch.device) -> int:
    """Shared memory a block may opt into (the Triton interpreter on the CPU: an H200's)."""
    return cuda_properties(device).shared_memory_per_block_optin if device.type == "cuda" else 232448


def merge_attn_states(outputs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """outputs [P, N, H, D], lses [P, N, H] -> (o [N, H, D] outputs.dtype, lse [N, H] fp32)."""
    P, N, H, D = outputs.shape
    o = outputs.new_empty(N, H, D)
    lse = torch.empty(N, H, dtype=torch.float32, device=outputs.device)
    lses = lses.float()
    with device_of(outputs):
        _merge(outputs, lses, outputs.stride()[:3], lses.stride(), P, o, lse)
    return o, lse


def mla_decode_paged(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                     scale: float, max_seq_len: int, num_splits: int | None = None, waves: int | None = None,
                     num_warps: int = 4, num_stages: int | None = None) -> tuple[Tensor, Tensor]:
    """q_latent [N, H, L], q_pe [N, H, R] (any float dtype and head/sequence strides, rounded to the cache dtype
    in the kernel) -> (o_latent [N, H, L] in q_latent's dtype, lse [N, H] fp32). max_seq_len sizes the grid;
    num_splits None picks as many splits as fill `waves` whole waves of programs. waves, num_splits, num_warps and
    num_stages are the knobs `benchmarks/gpu_mla.py --sweep` times; None takes split_rule.py's rule, whose
    defaults are the sweep's winners on an H200."""
    N, H, L = q_latent.shape
    R, PAGE = q_pe.shape[-1], kv_cache.shape[1]
    BLOCK_H, groups = block_h(H), head_groups(H)
    num_stages = num_stages or split_rule.num_stages(H, shared_per_block(q_latent.device))
    num_splits, pages_per_split = split_plan(N, groups, triton.cdiv(max_seq_len, PAGE), num_sm(q_latent.device),
                                             waves or split_rule.default_waves(num_stages), num_splits)
    block_tables, seq_lens = block_tables.to(q_latent.device), seq_lens.to(q_latent.device)  # int32 or int64
    o = q_latent.new_empty(N, H, L)
    lse = torch.empty(N, H, dtype=torch.float32, device=q_latent.device)
    direct = num_splits == 1
    if direct:
        o_part, lse_part = o, lse
        so = (o.stride(0), o.stride(1), 0)
    else:
        o_part = torch.empty(N, H, num_splits, L, dtype=torch.float32, device=q_latent.device)
        lse_part = torch.empty(N, H, num_splits, dtype=torch.float32, device=q_latent.device)
        so = o_part.stride()[:3]
    with device_of(q_latent):
        _decode_kernel[(N, num_splits, groups)](
            q_latent, q_pe, kv_cache, block_tables, seq_lens, o_part, lse_part, o, lse,
            scale * LOG2E, H, pages_per_split,
            q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
            *so, lse.stride(0), lse.stride(1),
            L=L, R=R, PAGE=PAGE, BLOCK_H=BLOCK_H, DIRECT=direct,
            num_warps=num_warps, num_stages=num_stages,
        )
        if not direct:
            _merge(o_part, lse_part, (o_part.stride(2), o_part.stride(0), o_part.stride(1)),
                   (lse_part.stride(2), lse_part.stride(0), lse_part.stride(1)), num_splits, o, lse)
    return o, lse
