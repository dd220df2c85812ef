"""The causal short convolution over a prefill batch's packed sequences, on the slot pool, in one Triton launch.

One program = (one token block of one sequence, BLOCK_C channels); the token blocks are the rows of a chunk
plan (`kernels.kda.ChunkPlan`: the batch's KDA chunks, built on the host once per step), so the grid needs no
length read back from the device and no program is idle. Each of the W taps is a [BLOCK_T, BLOCK_C] tile of x
rows; the first W-1 positions of a sequence, whose oldest taps are the slot's entries, are a small tile of the
first block's. Products and their sum in fp32, oldest input first (the reference's order), SiLU, one rounding
to x's dtype. Nothing but the output is allocated (the torch reference holds the fp32 [L, C, W] products of a
whole sequence).

The new state (the last W-1 inputs; for a sequence of L < W-1 tokens the tail of the old state first) is
written by the sequence's FIRST block: with BLOCK_T >= W-1 it is the only program that reads the slot, so no
other program can see a half-written state, and a barrier puts all of its own reads of the slot before its
writes. Padding rows that share the pad slot race there; their outputs are garbage nobody reads."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .._backend import device_of
from ..kda.chunk_plan import ChunkPlan

BLOCK_C = 128


@triton.jit
def _conv_rows(x, weight, slot_row, y, bos, t, rows_ok, c, c_ok, stride_xt, stride_yt, stride_sc, W: tl.constexpr,
               SILU: tl.constexpr, FROM_SLOT: tl.constexpr):
    """Writes y at positions t (where rows_ok) of the sequence starting at row bos: the W taps oldest first, each
    an x row, or with FROM_SLOT the slot's entry p + W - 1 for an input position p < 0."""
    acc = tl.zeros([t.shape[0], c.shape[0]], tl.float32)
    for j in tl.static_range(W):
        p = t + (j - (W - 1))  # tap j's input position in the sequence
        in_x = (rows_ok & (p >= 0))[:, None] & c_ok[None, :]
        v = tl.load(x + (bos + p)[:, None] * stride_xt + c[None, :], mask=in_x, other=0.0).to(tl.float32)
        if FROM_SLOT:
            in_slot = (rows_ok & (p < 0))[:, None] & c_ok[None, :]
            old = tl.load(slot_row + c[None, :] * stride_sc + (p + (W - 1))[:, None], mask=in_slot, other=0.0)
            v = tl.where(in_x, v, old.to(tl.float32))
        acc += v * tl.load(weight + c * W + j, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + (bos + t)[:, None] * stride_yt + c[None, :], acc.to(y.dtype.element_ty),
             mask=rows_ok[:, None] & c_ok[None, :])


@triton.jit
def _conv_prefill_kernel(x, weight, state, cu_seqlens, state_indices, chunk_indices, y, C, stride_xt, stride_yt,
                         stride_sn, stride_sc, W: tl.constexpr, W_POW2: tl.constexpr, SILU: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.load(chunk_indices + 2 * tl.program_id(0))
    block = tl.load(chunk_indices + 2 * tl.program_id(0) + 1)
    bos = tl.load(cu_seqlens + n)
    L = tl.load(cu_seqlens + n + 1) - bos
    slot_row = state + tl.load(state_indices + n) * stride_sn
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    # Positions >= W-1 from x alone. The first W-1 (the first block's) are a small tile of their own: a tap that
    # may read the slot in the big tile would let the slot's layout (contiguous along t) steer the tile's.
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    _conv_rows(x, weight, slot_row, y, bos, t, (t < L) & (t >= W - 1), c, c_ok, stride_xt, stride_yt, stride_sc,
               W, SILU, False)
    if block == 0:
        head = tl.arange(0, W_POW2)
        _conv_rows(x, weight, slot_row, y, bos, head, (head < L) & (head < W - 1), c, c_ok, stride_xt, stride_yt,
                   stride_sc, W, SILU, True)
        # the new state: entry k = the input at position L - (W-1) + k (the old entry L + k where that is < 0)
        q = L - (W - 1) + head
        k_ok = (head < W - 1)[None, :] & c_ok[:, None]
        from_x = (q >= 0)[None, :] & k_ok
        xk = tl.load(x + (bos + q)[None, :] * stride_xt + c[:, None], mask=from_x, other=0.0)
        old = tl.load(slot_row + c[:, None] * stride_sc + (q + (W - 1))[None, :], mask=(q < 0)[None, :] & k_ok,
                      other=0.0)
        new = tl.where(from_x, xk.to(state.dtype.element_ty), old)
        tl.debug_barrier()  # every thread's reads of the slot (the head's taps' too) come before the first write
        tl.store(slot_row + c[:, None] * stride_sc + head[None, :], new, mask=k_ok)


def conv_prefill(x: Tensor, weight: Tensor, conv_state: Tensor, state_indices: Tensor, plan: ChunkPlan,
                 silu: bool) -> Tensor:
    """x [T, C] (rows with a unit inner stride) -> y [T, C] in x.dtype; conv_state[state_indices[n]] advances by
    sequence n's tokens in place. plan: varlen, for these sequences, on x's device, its chunk size a power of
    two >= W-1 (so only a sequence's first block reaches into its slot); state_indices [N] int64 on x's device."""
    T, C = x.shape
    W = weight.shape[1]
    if not plan.varlen or plan.chunk_size & (plan.chunk_size - 1) or plan.chunk_size < W - 1:
        raise ValueError(f"the conv's token blocks need a varlen plan whose chunk size is a power of two >= W-1 "
                         f"= {W - 1}, got varlen {plan.varlen}, chunk size {plan.chunk_size}")
    y = x.new_empty(T, C)
    with device_of(x):
        _conv_prefill_kernel[(plan.num_chunks, triton.cdiv(C, BLOCK_C))](
            x, weight, conv_state, plan.cu_seqlens, state_indices, plan.chunk_indices, y, C, x.stride(0),
            y.stride(0), conv_state.stride(0), conv_state.stride(1), W=W, W_POW2=triton.next_power_of_2(W - 1),
            SILU=silu, BLOCK_T=plan.chunk_size, BLOCK_C=BLOCK_C, num_warps=4,
        )
    return y
