"""Depthwise causal short convolution (KDA q/k/v ShortConvolution, kernel 4) over varlen-packed
tokens, with the conv state of each sequence kept in a slot pool (vLLM/fla semantics).

The state holds the last W-1 PRE-activation inputs of each sequence, oldest first, so a sequence
can be fed in any number of pieces (prefill chunks, one-token decode) with the same result.
On CUDA a decode step (one token per sequence) is one Triton launch (`triton_conv.py`), and so is a
prefill (`triton_prefill.py`, over the token blocks of the batch's chunk plan); `last_backend`
records which form ran."""

from __future__ import annotations

import torch
from torch import Tensor

from .._backend import gpu_kernels, has_module
from ..kda import CHUNK_SIZE, ChunkPlan, plan_chunks
from . import naive

__all__ = ["causal_conv1d", "conv_verify", "conv_commit"]

# "causal_conv1d" -> "triton" (decode step) | "triton_prefill" | "torch" (the batched decode form) | "naive"
last_backend: dict[str, str] = {}


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    conv_state: Tensor,
    cu_seqlens: Tensor,
    state_indices: Tensor,
    activation: str | None = "silu",
    pad_slot: int | None = None,
    plan: ChunkPlan | None = None,
) -> Tensor:
    """y [T, C] = act(depthwise causal conv of x [T, C] with weight [C, W]), continuing each sequence
    n from conv_state[state_indices[n]] ([S, C, W-1] pool) and updating those rows in place.

    cu_seqlens [N+1] int64 packs N sequences of >= 1 token; state_indices [N] int64 are distinct
    slots, except `pad_slot`, which the padding rows of a fixed-shape batch share (their outputs are
    garbage, to be ignored). A fresh sequence needs its slot zeroed by the caller. activation: "silu" or None.

    Index values on the host are checked there. On a GPU, a decode step's (T == N) and a prefill's with
    `plan` (the batch's varlen chunk plan, which the KDA layer builds once per step for chunked KDA) come
    from the engine's batch and slot pool and are trusted: checking them would cost a host sync per layer.
    Without a plan, device indices are read back once (a sync) to be checked and planned."""
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
    N = cu_seqlens.numel() - 1
    if state_indices.dtype != torch.int64 or state_indices.shape != (N,):
        raise ValueError(f"state_indices must be int64 [N={N}], got {state_indices.dtype} {tuple(state_indices.shape)}")
    on_device = x.is_cuda and cu_seqlens.is_cuda and state_indices.is_cuda
    if on_device and T == N:
        return _decode_one_token(x, weight, conv_state, state_indices, activation)
    if plan is not None:
        _check_plan(plan, cu_seqlens, x)
    if not (on_device and plan is not None):
        seq_lens = _checked_seq_lens(cu_seqlens, state_indices, T, conv_state.shape[0], pad_slot)
    if gpu_kernels(x, weight, conv_state) and has_module("triton"):
        from . import triton_conv, triton_prefill

        if triton_conv.supports(x, weight, conv_state):
            plan = plan or plan_chunks(seq_lens, True, None, CHUNK_SIZE, x.device)
            last_backend["causal_conv1d"] = "triton_prefill"
            return triton_prefill.conv_prefill(x, weight, conv_state, state_indices.to(x.device, non_blocking=True),
                                               plan, activation == "silu")
    last_backend["causal_conv1d"] = "naive"
    return naive.causal_conv1d(x, weight, conv_state, cu_seqlens, state_indices, activation)


def _checked_seq_lens(cu_seqlens: Tensor, state_indices: Tensor, T: int, S: int, pad_slot: int | None) -> list[int]:
    """The sequences' lengths, once cu_seqlens and the slots are known to be valid (read on the host)."""
    bounds = cu_seqlens.tolist()
    seq_lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != T or min(seq_lens) < 1:
        raise ValueError(f"cu_seqlens must rise strictly from 0 to T={T}, got {bounds}")
    slots = state_indices.tolist()
    owned = [s for s in slots if s != pad_slot]
    if not all(0 <= s < S for s in slots) or len(set(owned)) != len(owned):
        raise ValueError(f"state_indices must be distinct slots in [0, {S}) (pad_slot {pad_slot} may repeat), "
                         f"got {slots}")
    return seq_lens


def _check_plan(plan: ChunkPlan, cu_seqlens: Tensor, x: Tensor) -> None:
    """The plan describes this call: its sequences' lengths (compared with cu_seqlens where those are on the host)."""
    N, T = cu_seqlens.numel() - 1, x.shape[0]
    lens = list(plan.seq_lens)
    if (not plan.varlen or plan.device != x.device or len(lens) != N or sum(lens) != T
            or (not cu_seqlens.is_cuda and cu_seqlens.diff().tolist() != lens)):
        raise ValueError(f"the chunk plan (varlen {plan.varlen}, lengths {lens} on {plan.device}) does not describe "
                         f"this call's N={N} sequences of T={T} tokens on {x.device}")


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


def conv_verify(x: Tensor, weight: Tensor, conv_state: Tensor, cu_seqlens: list[int], state_indices: list[int],
                activation: str | None = "silu") -> Tensor:
    """`causal_conv1d` over the verify rows of a speculative step (host `cu_seqlens` and slots), the slots only
    read; `conv_commit` moves each window by the accepted tokens afterwards."""
    if x.dim() != 2 or weight.dim() != 2 or conv_state.shape[1:] != (x.shape[1], weight.shape[1] - 1):
        raise ValueError(f"conv_verify: x [T, C], weight [C, W], conv_state [S, C, W-1]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(conv_state.shape)}")
    if len(cu_seqlens) != len(state_indices) + 1 or cu_seqlens[-1] != x.shape[0]:
        raise ValueError(f"conv_verify: cu_seqlens {cu_seqlens} must pack T={x.shape[0]} tokens of "
                         f"{len(state_indices)} sequences")
    last_backend["conv_verify"] = "naive"
    return naive.conv_verify(x, weight, conv_state, cu_seqlens, state_indices, activation)


def conv_commit(conv_state: Tensor, x: Tensor, cu_seqlens: list[int], state_indices: list[int],
                commit_lens: list[int]) -> None:
    """Slot n's window after its first commit_lens[n] verified pre-conv inputs x [T, C] (copies: bit-exact)."""
    if len(commit_lens) != len(state_indices) or len(cu_seqlens) != len(state_indices) + 1:
        raise ValueError("conv_commit: one commit length and one slot a sequence")
    last_backend["conv_commit"] = "naive"
    naive.conv_commit(conv_state, x, cu_seqlens, state_indices, commit_lens)
