"""KDA (Kimi Delta Attention): the gate, chunked prefill, token-by-token reference and pooled decode.

Layouts follow fla: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] fp32 log decay; beta [B, T, H]
(already sigmoid-ed); states [N, H, K, V] fp32 ([K, V], not FlashKDA's V-first). Varlen packs N
sequences into B = 1 with cu_seqlens [N+1]. The public functions validate, then run on CUDA fla's chunked
prefill (`fla_ops.py`: bf16/fp16 inputs, fla-core installed) and our Triton decode step (`triton_decode.py`),
or else `naive.py`; `last_backend[name]` records which."""

from __future__ import annotations

import torch
from dataclasses import dataclass

from torch import Tensor

from .._backend import AUTOTUNE_FLUSH_BYTES, gpu_kernels, has_module
from . import naive
from .chunk_plan import ChunkPlan, check_checkpoint_offsets, plan_chunks

CHUNK_SIZE = 64  # chunked prefill's default chunk: fla's, and the one the model's batches plan for
FLA_SUB_CHUNK = 16  # fla's intra-chunk sub-block (`BC` of `chunk_kda_fwd_intra`): fp32 diagonal blocks [T, H, 16]
last_backend: dict[str, str] = {}  # "chunk_kda" -> "fla" | "naive", "kda_decode" -> "triton" | "naive"

__all__ = ["CHUNK_SIZE", "ChunkPlan", "kda_gate", "chunk_kda", "chunk_kda_workspace_bytes", "plan_chunks",
           "recurrent_kda", "kda_decode", "KdaRecords", "kda_verify", "kda_commit"]


def chunk_kda_workspace_bytes(num_tokens: int, num_seqs: int, num_heads: int, head_dim: int, itemsize: int) -> int:
    """Peak bytes `chunk_kda` allocates inside, on fla's path (`fla_ops.py`, 16-bit q, k, v of `itemsize` bytes),
    for `num_tokens` tokens of `num_seqs` sequences and `num_heads` heads of K = V = `head_dim`: q, k, v made
    contiguous, the fp32 in-chunk gate cumsum, w, u, kg, Aqk, then the larger of the intra-chunk Akk with its fp32
    diagonal blocks [T, H, FLA_SUB_CHUNK] and the chunk-start states h (a CHUNK_SIZE chunk a sequence, one extra),
    v_new and o; plus the autotuner's flush buffer (`AUTOTUNE_FLUSH_BYTES`) for a new shape. Its arguments, the
    states passed in and out and its output are the caller's."""
    T, H, d, b = num_tokens, num_heads, head_dim, itemsize
    P = H * d
    num_chunks = -(-T // CHUNK_SIZE) + num_seqs
    intra = T * H * (CHUNK_SIZE * b + FLA_SUB_CHUNK * 4)
    inter = num_chunks * H * d * d * b + 2 * T * P * b
    return T * (6 * P * b + 4 * P + H * CHUNK_SIZE * b) + max(intra, inter) + AUTOTUNE_FLUSH_BYTES


def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None = None) -> Tensor:
    """fp32 log decay g [..., H, K] from the raw f_b output f [..., H, K].

    lower_bound None: -exp(A_log[h]) * softplus(f + dt_bias) (Kimi Linear, g in (-inf, 0)).
    Otherwise lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)) (K3 safe gate, g in (lower_bound, 0),
    which bounds the in-chunk decay range). A_log [H] is per head; dt_bias is [H*K] or [H, K].
    On CUDA one Triton launch (`triton_gate.py`)."""
    if f.dim() < 2 or not f.is_floating_point():
        raise ValueError(f"f must be a floating [..., H, K] tensor, got {f.dtype} {tuple(f.shape)}")
    H, K = f.shape[-2:]
    if A_log.shape != (H,):
        raise ValueError(f"A_log must be [H={H}] (per head), got {tuple(A_log.shape)}")
    if dt_bias.shape not in ((H * K,), (H, K)):
        raise ValueError(f"dt_bias must be [H*K={H * K}] or [H={H}, K={K}], got {tuple(dt_bias.shape)}")
    if lower_bound is not None and not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"lower_bound must be in [-5, 0), got {lower_bound}")
    if gpu_kernels(f, A_log, dt_bias) and has_module("triton"):
        from . import triton_gate

        last_backend["kda_gate"] = "triton"
        return triton_gate.kda_gate(f, A_log, dt_bias, lower_bound)
    last_backend["kda_gate"] = "naive"
    return naive.kda_gate(f, A_log, dt_bias, lower_bound)


def _check_token_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, layout: str) -> None:
    """q, k, g [*lead, H, K]; v [*lead, H, V]; beta [*lead, H]; layout names the leading dims."""
    if q.dim() != len(layout.split(", ")) + 2:
        raise ValueError(f"q must be [{layout}, H, K], got {tuple(q.shape)}")
    for name, t in (("k", k), ("g", g)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must match q [{layout}, H, K] {tuple(q.shape)}, got {tuple(t.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v must be [{layout}, H, V] with q's {tuple(q.shape[:-1])}, got {tuple(v.shape)}")
    if beta.shape != q.shape[:-1]:
        raise ValueError(f"beta must be [{layout}, H] = {tuple(q.shape[:-1])}, got {tuple(beta.shape)}")
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if g.dtype != torch.float32:
        raise ValueError(f"g (log decay) must be float32, got {g.dtype}")
    if not beta.is_floating_point():
        raise ValueError(f"beta must be floating, got {beta.dtype}")


def _check_state(name: str, state: Tensor, rows: str, H: int, K: int, V: int) -> None:
    if state.dtype != torch.float32 or state.dim() != 4 or state.shape[1:] != (H, K, V):
        raise ValueError(
            f"{name} must be float32 [{rows}, H={H}, K={K}, V={V}], got {state.dtype} {tuple(state.shape)}"
        )


def _check_sequences(q: Tensor, v: Tensor, initial_state: Tensor | None, cu_seqlens: Tensor | None,
                     checkpoint_offsets: Tensor | None, plan: ChunkPlan | None = None
                     ) -> tuple[list[int], list[int] | None]:
    """Validate; returns (tokens of each sequence, checkpoint offsets or None) as host lists.

    Without a plan the values are checked on host copies: a device tensor is read back here (one sync),
    a host tensor costs none. With a plan (validated when it was built) only shapes are checked, and
    the tensors' values are compared with it where they are on the host; device ones are trusted."""
    B, T, H, K = q.shape
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"varlen (cu_seqlens) needs B == 1, got B={B}")
        if cu_seqlens.dtype != torch.int64 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                f"cu_seqlens must be int64 [N+1], N >= 1, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
            )
    if plan is not None:
        lens, offsets = _plan_sequences(q, cu_seqlens, checkpoint_offsets, plan)
    else:
        lens, offsets = _read_sequences(q, cu_seqlens, checkpoint_offsets)
    N = len(lens)
    if initial_state is not None:
        _check_state("initial_state", initial_state, f"N={N}", H, K, v.shape[-1])
        if initial_state.shape[0] != N:
            raise ValueError(f"initial_state must have N={N} rows (one per sequence), got {initial_state.shape[0]}")
    if checkpoint_offsets is not None:
        if checkpoint_offsets.dtype != torch.int64 or checkpoint_offsets.shape != (N,):
            raise ValueError(f"checkpoint_offsets must be int64 [N={N}], got "
                             f"{checkpoint_offsets.dtype} {tuple(checkpoint_offsets.shape)}")
        if plan is None:
            check_checkpoint_offsets(offsets, lens)
    return lens, offsets


def _read_sequences(q: Tensor, cu_seqlens: Tensor | None, checkpoint_offsets: Tensor | None
                    ) -> tuple[list[int], list[int] | None]:
    """Host copies of the sequence tensors (a device tensor costs a sync); lengths checked."""
    B, T = q.shape[:2]
    if cu_seqlens is None:
        lens = [T] * B
    else:
        cu = cu_seqlens.tolist()
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        if cu[0] != 0 or cu[-1] != T or min(lens) < 1:
            raise ValueError(f"cu_seqlens must rise strictly from 0 to T={T}, got {cu}")
    return lens, None if checkpoint_offsets is None else checkpoint_offsets.tolist()


def _plan_sequences(q: Tensor, cu_seqlens: Tensor | None, checkpoint_offsets: Tensor | None,
                    plan: ChunkPlan) -> tuple[list[int], list[int] | None]:
    """The plan's host lists, once it is known to describe this call."""
    B, T = q.shape[:2]
    lens, offsets = list(plan.seq_lens), None if plan.checkpoint_offsets is None else list(plan.checkpoint_offsets)
    if plan.device != q.device:
        raise ValueError(f"the chunk plan lives on {plan.device}, the inputs on {q.device}")
    if plan.varlen != (cu_seqlens is not None) or (checkpoint_offsets is None) != (offsets is None):
        raise ValueError("the chunk plan must be built for the same varlen / checkpoint form as the call "
                         f"(plan: varlen {plan.varlen}, checkpoints {offsets is not None}; call: varlen "
                         f"{cu_seqlens is not None}, checkpoints {checkpoint_offsets is not None})")
    if sum(lens) != B * T or (cu_seqlens is None and lens != [T] * B):
        raise ValueError(f"the chunk plan's sequence lengths {lens} do not pack q's B={B} x T={T} tokens")
    if cu_seqlens is not None:
        cu = None if cu_seqlens.is_cuda else cu_seqlens.tolist()
        if cu_seqlens.numel() != len(lens) + 1 or (cu is not None and (
                cu[0] != 0 or [b - a for a, b in zip(cu[:-1], cu[1:])] != lens)):
            raise ValueError(f"cu_seqlens {cu if cu is not None else tuple(cu_seqlens.shape)} do not match the "
                             f"chunk plan's lengths {lens}")
    if checkpoint_offsets is not None and not checkpoint_offsets.is_cuda and checkpoint_offsets.tolist() != offsets:
        raise ValueError(f"checkpoint_offsets {checkpoint_offsets.tolist()} differ from the chunk plan's {offsets}")
    return lens, offsets


def recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    checkpoint_offsets: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Token-by-token KDA: the exact reference every other form is tested against.

    Returns (o [B, T, H, V] in q.dtype, final_state fp32 [N, H, K, V], checkpoints fp32 [N, H, K, V]
    or None). checkpoints[n] is the state after the first checkpoint_offsets[n] tokens of sequence n
    in this call (zeros where the offset is -1). scale defaults to K^-0.5; initial_state None = zeros."""
    _check_token_inputs(q, k, v, g, beta, "B, T")
    _check_sequences(q, v, initial_state, cu_seqlens, checkpoint_offsets)
    return naive.recurrent_kda(q, k, v, g, beta, scale, initial_state, cu_seqlens, checkpoint_offsets,
                               use_qk_l2norm_in_kernel)


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    checkpoint_offsets: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = CHUNK_SIZE,
    gate_lower_bound: float | None = None,
    plan: ChunkPlan | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Chunked (WY) KDA for prefill; same arguments and results as `recurrent_kda`.

    Checkpoints come out of the same single pass over the chunks (a prefix cache snapshot mid-prefill),
    including offsets that fall inside a chunk; on the GPU they are fp32 like the final state, built
    from fla's bf16 chunk-start states with the in-chunk update in fp32.
    cu_seqlens and checkpoint_offsets may live on the host or on q's device: host tensors cost the GPU
    path no sync (they are validated where they are and sent in one non-blocking copy); device ones
    are read back once for validation, which drains the GPU queue.
    plan: `plan_chunks` over the same sequences on q's device, validated when built. A batch shares
    one plan across all its KDA layers (the engine's `ForwardBatch.kda_chunk_plan`), so a layer neither
    rebuilds it nor reads anything back; the tensors are then checked against it only where they
    are on the host (device ones are trusted, as in `kda_decode`).
    gate_lower_bound: the caller guarantees g >= gate_lower_bound (K3 safe gate, in [-5, 0)); lets fla
    use its bounded-gate tensor-core path. The result does not depend on it beyond rounding."""
    _check_token_inputs(q, k, v, g, beta, "B, T")
    lens, offsets = _check_sequences(q, v, initial_state, cu_seqlens, checkpoint_offsets, plan)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if plan is not None and plan.chunk_size != chunk_size:
        raise ValueError(f"the chunk plan is for chunk_size {plan.chunk_size}, the call asks for {chunk_size}")
    if gate_lower_bound is not None and not -5.0 <= gate_lower_bound < 0.0:
        raise ValueError(f"gate_lower_bound must be in [-5, 0), got {gate_lower_bound}")
    if gpu_kernels(q, k, v, g, beta, initial_state) and has_module("fla"):
        from . import fla_ops

        if fla_ops.supports_chunk(q, v, chunk_size):
            last_backend["chunk_kda"] = "fla"
            if plan is None:
                plan = plan_chunks(lens, cu_seqlens is not None, offsets, chunk_size, q.device)
            return fla_ops.chunk_kda(q, k, v, g, beta, scale, initial_state, plan, use_qk_l2norm_in_kernel,
                                     chunk_size, safe_gate=gate_lower_bound is not None)
    last_backend["chunk_kda"] = "naive"
    return naive.chunk_kda(q, k, v, g, beta, scale, initial_state, cu_seqlens, checkpoint_offsets,
                           use_qk_l2norm_in_kernel, chunk_size)


def kda_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    pad_slot: int | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
) -> Tensor:
    """One token for each of N sequences (continuous-batching decode); returns o [N, H, V] in q.dtype.

    q, k, g [N, H, K]; v [N, H, V]; beta [N, H], or its logits with use_beta_sigmoid_in_kernel (the sigmoid
    then runs in fp32 inside: two launches a layer fewer than the caller's cast + sigmoid). Sequence n reads
    and writes its state in place at state_pool[state_indices[n]] (pool fp32 [S, H, K, V]); no other slot is
    touched. Indices are distinct, except `pad_slot`, which the padding rows of a fixed-shape batch share
    (garbage outputs)."""
    _check_token_inputs(q, k, v, g, beta, "N")
    N, H, K = q.shape
    _check_state("state_pool", state_pool, "S", H, K, v.shape[-1])
    S = state_pool.shape[0]
    if state_indices.dtype != torch.int64 or state_indices.shape != (N,):
        raise ValueError(f"state_indices must be int64 [N={N}], got {state_indices.dtype} {tuple(state_indices.shape)}")
    # Values are checked where they live on the CPU; GPU-resident indices come from the slot pool and are
    # trusted, so a decode step costs no sync per layer.
    if not state_indices.is_cuda:
        owned = state_indices if pad_slot is None else state_indices[state_indices != pad_slot]
        if ((state_indices < 0) | (state_indices >= S)).any() or owned.unique().numel() != owned.numel():
            raise ValueError(f"state_indices must be distinct slots in [0, {S}) (pad_slot {pad_slot} may repeat), "
                             f"got {state_indices.tolist()}")
    if gpu_kernels(q, k, v, g, beta, state_pool) and has_module("triton"):
        from . import triton_decode

        if triton_decode.supports(q, k, v, g, state_pool):
            last_backend["kda_decode"] = "triton"
            return triton_decode.kda_decode(q, k, v, g, beta, state_pool, state_indices.to(q.device), scale,
                                            use_qk_l2norm_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel)
    last_backend["kda_decode"] = "naive"
    return naive.kda_decode(q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm_in_kernel,
                            use_beta_sigmoid_in_kernel)


@dataclass(frozen=True)
class KdaRecords:
    """What a verify pass keeps of each token for the RecoverSSM commit (fp32): the l2-normalized key, the
    delta-rule update u (computed from the true state along the drafted path) and the log decay. Lives for
    one step."""

    k_hat: Tensor  # [T, H, K]
    u: Tensor  # [T, H, V]
    g: Tensor  # [T, H, K]


def _check_spans(name: str, state_indices: list[int], cu_seqlens: list[int], T: int, S: int) -> None:
    N = len(state_indices)
    if len(cu_seqlens) != N + 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != T or any(
            b <= a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])):
        raise ValueError(f"{name}: cu_seqlens must rise strictly from 0 to T={T} over N={N} sequences, got {cu_seqlens}")
    if len(set(state_indices)) != N or not all(0 <= s < S for s in state_indices):
        raise ValueError(f"{name}: state_indices must be distinct slots in [0, {S}), got {state_indices}")


def kda_verify(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, state_indices: list[int],
    cu_seqlens: list[int], scale: float | None = None, use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
) -> tuple[Tensor, KdaRecords]:
    """The verify rows of a speculative step: N sequences of 1 + k tokens (host `cu_seqlens` [N+1]), sequence n
    continuing the state at state_pool[state_indices[n]] one decode step a token, as `kda_decode` would over
    consecutive steps (the same operations: bit-identical on the reference path). The pool is only read.
    Returns (o [T, H, V] in q.dtype, the records `kda_commit` folds). Arguments as in `kda_decode`."""
    _check_token_inputs(q, k, v, g, beta, "T")
    _check_state("state_pool", state_pool, "S", *q.shape[1:], v.shape[-1])
    _check_spans("kda_verify", state_indices, cu_seqlens, q.shape[0], state_pool.shape[0])
    last_backend["kda_verify"] = "naive"
    o, k_hat, u, g32 = naive.kda_verify(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, scale,
                                        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel)
    return o, KdaRecords(k_hat, u, g32)


def kda_commit(state_pool: Tensor, records: KdaRecords, state_indices: list[int], cu_seqlens: list[int],
               commit_lens: list[int]) -> None:
    """RecoverSSM: after rejection, fold each sequence's accepted prefix (its first commit_lens[n] verified tokens,
    0 for none) into its slot, so the slot holds the state after exactly those tokens. In place, those slots only."""
    T = records.u.shape[0]
    _check_spans("kda_commit", state_indices, cu_seqlens, T, state_pool.shape[0])
    if len(commit_lens) != len(state_indices) or any(
            not 0 <= c <= b - a for c, a, b in zip(commit_lens, cu_seqlens[:-1], cu_seqlens[1:])):
        raise ValueError(f"commit_lens must lie in [0, tokens of its sequence], got {commit_lens} for {cu_seqlens}")
    last_backend["kda_commit"] = "naive"
    naive.kda_commit(state_pool, records.k_hat, records.u, records.g, state_indices, cu_seqlens, commit_lens)
