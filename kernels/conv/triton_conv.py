"""One new token per sequence through the causal short convolution, on the slot pool, in one Triton launch.

One program = (sequence n, BLOCK_C channels): it reads the W-1 inputs the slot keeps, the token and the
weights, writes act(sum_j weight[:, j] * window[j]) and shifts the token into the slot. The torch form of
the same step is ~10 launches (gather, cat, casts, product, sum, scatter, SiLU) per KDA layer, which at
batch 1 cost more than the layer's recurrence. Padding rows of a fixed-shape batch share the pad slot:
their writes race there and their outputs are garbage, which nobody reads."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .._backend import device_of

BLOCK_C = 256


@triton.jit
def _conv_decode_kernel(x, weight, state, state_indices, y, C, stride_xn, stride_yn, stride_sn, stride_sc,
                        W: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    xt = tl.load(x + n * stride_xn + c, mask=ok, other=0.0)
    row = state + tl.load(state_indices + n).to(tl.int64) * stride_sn + c * stride_sc
    acc = tl.zeros([BLOCK_C], tl.float32)
    older = tl.load(row, mask=ok, other=0.0)  # window[0], the oldest input
    for j in tl.static_range(W - 1):  # the reference's order: oldest first, the new token last
        acc += older.to(tl.float32) * tl.load(weight + c * W + j, mask=ok, other=0.0).to(tl.float32)
        if j < W - 2:
            newer = tl.load(row + (j + 1), mask=ok, other=0.0)
            tl.store(row + j, newer, mask=ok)  # shift left: the slot keeps the last W-1 inputs
            older = newer
    acc += xt.to(tl.float32) * tl.load(weight + c * W + (W - 1), mask=ok, other=0.0).to(tl.float32)
    tl.store(row + (W - 2), xt.to(state.dtype.element_ty), mask=ok)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + n * stride_yn + c, acc.to(y.dtype.element_ty), mask=ok)


def supports(x: Tensor, weight: Tensor, conv_state: Tensor) -> bool:
    """Rows of x with a unit inner stride, contiguous weights, a pool whose last dim is contiguous, W >= 2."""
    return (x.stride(-1) == 1 and weight.is_contiguous() and conv_state.stride(-1) == 1
            and weight.shape[1] >= 2)


def conv_decode(x: Tensor, weight: Tensor, conv_state: Tensor, state_indices: Tensor, silu: bool) -> Tensor:
    """x [N, C] (one token each) -> y [N, C] in x.dtype; conv_state[state_indices[n]] advances in place."""
    N, C = x.shape
    y = x.new_empty(N, C)
    if N == 0:
        return y
    with device_of(x):
        _conv_decode_kernel[(N, triton.cdiv(C, BLOCK_C))](
            x, weight, conv_state, state_indices, y, C, x.stride(0), y.stride(0), conv_state.stride(0),
            conv_state.stride(1), W=weight.shape[1], SILU=silu, BLOCK_C=BLOCK_C, num_warps=4,
        )
    return y
