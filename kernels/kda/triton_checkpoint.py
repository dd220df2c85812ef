"""Mid-chunk KDA checkpoints from the chunk states of the same pass: one Triton launch for all of them.

The state after m tokens of chunk j (naive._advance, G = in-chunk cumsum of g in log2 units):

    S = exp2(G_m) ⊙ h[j] + Σ_{i<m} (exp2(G_m - G_i) ⊙ k_i) v_new_i^T

h[j] is fla's chunk-start state (bf16, as fla keeps it: it rounds the state to bf16 for every
product anyway); the decay and the in-chunk sum run in fp32 (the sum on tensor cores as 3xTF32, whose
error is fp32's: the decayed keys are split into a TF32 head and tail, v_new is bf16 and exact in TF32),
so a checkpoint is as exact as a state fla itself would carry across that chunk. A program owns one
(sequence, head, BK rows, BV columns) tile of the output and writes it whole: the checkpoint, or zeros
for a sequence without one (m = 0), so the output is allocated empty and the call costs this one
launch. (Small tiles and 3xTF32 keep it a small part of the prefill, where an fp32 FMA form with [128, 64]
tiles took a quarter of it: docs/BENCHMARKS.md.) No host sync, and one launch where the torch form of this
sum is ~15 small ones."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

BK, BV = 32, 64


@triton.jit
def _checkpoint_kernel(h, k, gc, v_new, plan, out, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_v, i_n = tl.program_id(0), tl.program_id(1)
    i_h, i_k = tl.program_id(2) // tl.cdiv(K, BK), tl.program_id(2) % tl.cdiv(K, BK)
    tok0 = tl.load(plan + i_n * 3).to(tl.int64)  # first token row of the chunk
    m = tl.load(plan + i_n * 3 + 1).to(tl.int64)  # its tokens before the checkpoint, 1..BT; 0: none
    chunk = tl.load(plan + i_n * 3 + 2).to(tl.int64)  # row of its start state in h
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_out = out + ((i_n * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    if m > 0:
        o_t = tl.arange(0, BT)
        m_t = o_t < m
        m_tk = m_t[:, None] & m_k[None, :]
        g_last = tl.load(gc + ((tok0 + m - 1) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_h = tl.load(h + ((chunk * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.0)
        b_s = b_h.to(tl.float32) * tl.exp2(g_last)[:, None]
        rows = tok0 + o_t
        b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_g = tl.load(gc + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        b_kd = tl.where(m_tk, b_k * tl.exp2(g_last[None, :] - b_g), 0.0)
        b_vn = tl.load(v_new + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                       other=0.0).to(tl.float32)
        b_s += tl.dot(tl.trans(b_kd), b_vn, input_precision="tf32x3")
        tl.store(p_out, b_s, mask=m_kv)
    else:
        tl.store(p_out, tl.zeros([BK, BV], dtype=tl.float32), mask=m_kv)


def checkpoint_states(h: Tensor, k: Tensor, gc: Tensor, v_new: Tensor, plan: Tensor, out: Tensor,
                      chunk_size: int) -> None:
    """out[n] = state after plan[n, 1] tokens of the chunk starting at token row plan[n, 0], whose start
    state is chunk row plan[n, 2] of h; zeros where plan[n, 1] = 0. out [N, H, K, V] fp32, every element
    written; h [..., H, K, V] (its leading dims flatten to chunk rows), k, gc [..., H, K] and v_new
    [..., H, V] (leading dims flatten to token rows); all contiguous."""
    N, H, K, V = out.shape
    grid = (triton.cdiv(V, BV), N, H * triton.cdiv(K, BK))
    _checkpoint_kernel[grid](h, k, gc, v_new, plan, out, H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, num_warps=4)
