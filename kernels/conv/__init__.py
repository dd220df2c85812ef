"""Depthwise causal short convolution (KDA q/k/v ShortConvolution, kernel 4) over varlen-packed
tokens, with the conv state of each sequence kept in a slot pool (vLLM/fla semantics).

The state holds the last W-1 PRE-activation inputs of each sequence, oldest first, so a sequence
can be fed in any number of pieces (prefill chunks, one-token decode) with the same result.
On CUDA a decode step (one token per sequence) is one Triton launch (`triton_conv.py`); `last_backend`
records which form ran."""

from __future__ import annotations

import torch
from torch import Tensor

from .._backend import gpu_kernels, has_module
from . import naive

__all__ = ["causal_conv1d"]

last_backend: dict[str, str] = {}  # "causal_conv1d" -> "triton" | "torch" (the batched decode form) | "naive"


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    conv_state: Tensor,
    cu_seqlens: Tensor,
    state_indices: Tensor,
    activation: str | None = "silu",
    pad_slot: int | None = None,
) -> Tensor:
    """y [T, C] = act(depthwise causal conv of x [T, C] with weight [C, W]), continuing each sequence
    n from conv_state[state_indices[n]] ([S, C, W-1] pool) and updating those rows in place.

    cu_seqlens [N+1] int64 packs N sequences of >= 1 token; state_indices [N] int64 are distinct
    slots, except `pad_slot`, which the padding rows of a fixed-shape batch share (their outputs are
    garbage, to be ignored). A fresh sequence needs its slot zeroed by the caller. activation: "silu" or None."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [T, C] tensor, got {x.dtype} {tuple(x.shape)}")
    T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C={C}, W>=1], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1:] != (C, W - 1):
        raise ValueError(f"conv_state must be [S, C={C}, W-1={W - 1}], got {tuple(conv_state.shape)}")
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if cu_seqlens.dtype != torch.int64 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be int64 [N+1] with N >= 1, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    N, S = cu_seqlens.numel() - 1, conv_state.shape[0]
    if state_indices.dtype != torch.int64 or state_indices.shape != (N,):
        raise ValueError(f"state_indices must be int64 [N={N}], got {state_indices.dtype} {tuple(state_indices.shape)}")
    if x.is_cuda and cu_seqlens.is_cuda and state_indices.is_cuda:
        # Values on a GPU come from the engine's batch and slot pool and are trusted (as in kda_decode):
        # checking them would cost a host sync per layer. T == N means one token per sequence (decode).
        if T == N:
            return _decode_one_token(x, weight, conv_state, state_indices, activation)
        last_backend["causal_conv1d"] = "naive"
        return naive.causal_conv1d(x, weight, conv_state, cu_seqlens, state_indices, activation)
    lens = cu_seqlens.diff()
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != T or (lens < 1).any():
        raise ValueError(f"cu_seqlens must rise strictly from 0 to T={T}, got {cu_seqlens.tolist()}")
    owned = state_indices if pad_slot is None else state_indices[state_indices != pad_slot]
    if ((state_indices < 0) | (state_indices >= S)).any() or owned.unique().numel() != owned.numel():
        raise ValueError(f"state_indices must be distinct slots in [0, {S}) (pad_slot {pad_slot} may repeat), "
                         f"got {state_indices.tolist()}")
    last_backend["causal_conv1d"] = "naive"
    return naive.causal_conv1d(x, weight, conv_state, cu_seqlens, state_indices, activation)


def _decode_one_token(x: Tensor, weight: Tensor, conv_state: Tensor, state_indices: Tensor,
                      activation: str | None) -> Tensor:
    """One new token per sequence, all sequences at once (no per-sequence loop, no host sync): the same
    products and W-term sums as the reference's window, in fp32; one Triton launch where it can."""
    if gpu_kernels(x, weight, conv_state) and has_module("triton"):
        from . import triton_conv

        if triton_conv.supports(x, weight, conv_state):
            last_backend["causal_conv1d"] = "triton"
            return triton_conv.conv_decode(x, weight, conv_state, state_indices, activation == "silu")
    last_backend["causal_conv1d"] = "torch"
    window = torch.cat([conv_state[state_indices].float(), x.float()[:, :, None]], dim=-1)  # [N, C, W]
    y = (window * weight.float()).sum(-1)
    conv_state[state_indices] = window[:, :, 1:].to(conv_state.dtype)
    if activation == "silu":
        y = torch.nn.functional.silu(y)
    return y.to(x.dtype)
