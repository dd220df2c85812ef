"""Plain-torch KDA (Kimi Delta Attention), fp32 throughout. Per token, per head, state S [K, V]:

    S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale q_t)                                   (the state AFTER the update)

`recurrent_kda` walks the tokens (fla naive_recurrent_kda) and is the exact reference;
`chunk_kda` is the chunked WY form (fla chunk_kda, model/K3_MODEL.md §2) that GPU kernels follow.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..norm.naive import l2_normalize

# (q, k, v, g, beta, S, checkpoint_at) of one sequence -> (o, final S, S after checkpoint_at tokens or None)
SequenceFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int], tuple[Tensor, Tensor, Tensor | None]]


def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None = None) -> Tensor:
    H, K = f.shape[-2:]
    x = f.float() + dt_bias.float().reshape(H, K)  # [..., H, K]
    a = A_log.float().exp()[:, None]  # [H, 1]: one decay rate per head
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None, use_qk_l2norm: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fp32 copies with q pre-scaled, so the update loops below are pure state math."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v.float(), g.float(), beta.float()


def _update(S: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """One token's state update: (S after it, its delta-rule update u [..., H, V])."""
    S = S * g.exp()[..., None]
    u = beta[..., None] * (v - torch.einsum("...hk,...hkv->...hv", k, S))  # [..., H, V]
    return _fold(S, k, u), u


def _fold(S_decayed: Tensor, k: Tensor, u: Tensor) -> Tensor:
    """The rank-1 half of the update, S' + k u^T: shared by the recurrence and the RecoverSSM commit."""
    return S_decayed + k[..., None] * u[..., None, :]


def _step(S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """One token: S [..., H, K, V]; q (pre-scaled), k, g [..., H, K]; v [..., H, V]; beta [..., H]."""
    S, _ = _update(S, k, v, g, beta)
    return S, torch.einsum("...hk,...hkv->...hv", q, S)


def _recurrent_sequence(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, checkpoint_at: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    o = v.new_empty(v.shape)  # [L, H, V]
    checkpoint = None
    for t in range(q.shape[0]):
        S, o[t] = _step(S, q[t], k[t], v[t], g[t], beta[t])
        if t + 1 == checkpoint_at:
            checkpoint = S
    return o, S, checkpoint


def _advance(S: Tensor, G: Tensor, k: Tensor, v_new: Tensor, m: int) -> Tensor:
    """State after the first m tokens of a chunk entered with S [H, K, V]; G [H, c, K] is the in-chunk
    cumulative log decay. T is lower triangular, so the first m rows of the chunk's WY quantities
    (v_new [H, c, V]) are exactly those of the m-token prefix: a mid-chunk state needs no re-run."""
    G_m = G[:, m - 1]  # [H, K]
    k_decayed = (G_m[:, None] - G[:, :m]).exp() * k[:, :m]  # [H, m, K]
    return G_m.exp()[..., None] * S + k_decayed.transpose(1, 2) @ v_new[:, :m]


def _chunk_sequence(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, checkpoint_at: int, chunk_size: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    L = q.shape[0]
    o = v.new_empty(v.shape)  # [L, H, V]
    checkpoint = None
    for s in range(0, L, chunk_size):
        e = min(s + chunk_size, L)
        c = e - s
        qc, kc, gc, vc = (t[s:e].transpose(0, 1) for t in (q, k, g, v))  # [H, c, K|V]
        bc = beta[s:e].T  # [H, c]
        G = gc.cumsum(1)  # [H, c, K]
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        # decay[h, i, j, :] = exp(G_i - G_j) for j <= i, else 0 (never exp of a positive number)
        decay = (G[:, :, None] - G[:, None]).masked_fill(~causal[..., None], float("-inf")).exp()
        # (x_i * k_j * decay_ij).sum(K) as one broadcast: several times faster on CPU than a 3-operand einsum
        Akk = (((kc[:, :, None] * kc[:, None]) * decay).sum(-1) * bc[..., None]).tril(-1)
        eye = torch.eye(c, device=q.device)
        T = torch.linalg.solve_triangular(eye + Akk, torch.diag_embed(bc), upper=False)  # (I + Akk)^-1 diag(beta)
        w, u = T @ (G.exp() * kc), T @ vc  # WY: [H, c, K], [H, c, V]
        Aqk = ((qc[:, :, None] * kc[:, None]) * decay).sum(-1)  # [H, c, c], j <= i
        v_new = u - w @ S  # [H, c, V]: the per-token delta-rule updates
        o[s:e] = ((qc * G.exp()) @ S + Aqk @ v_new).transpose(0, 1)
        if s < checkpoint_at <= e:
            checkpoint = _advance(S, G, kc, v_new, checkpoint_at - s)
        S = _advance(S, G, kc, v_new, c)
    return o, S, checkpoint


def _run(
    sequence_fn: SequenceFn,
    q: Tensor,  # [B, T, H, K]
    k: Tensor,  # [B, T, H, K]
    v: Tensor,  # [B, T, H, V]
    g: Tensor,  # [B, T, H, K]
    beta: Tensor,  # [B, T, H]
    scale: float | None,
    initial_state: Tensor | None,  # [N, H, K, V]
    cu_seqlens: Tensor | None,  # [N+1]
    checkpoint_offsets: Tensor | None,  # [N]
    use_qk_l2norm_in_kernel: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Split the batch into sequences (rows of B, or cu_seqlens spans of a B=1 packed batch) and run each."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, bos, eos) for bos, eos in zip(bounds[:-1], bounds[1:])]
    N = len(spans)
    offsets = [-1] * N if checkpoint_offsets is None else checkpoint_offsets.tolist()
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)
    final_state = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
    checkpoints = None if checkpoint_offsets is None else torch.zeros_like(final_state)
    for n, (b, bos, eos) in enumerate(spans):
        S = final_state.new_zeros(H, K, V) if initial_state is None else initial_state[n].float()
        o[b, bos:eos], final_state[n], checkpoint = sequence_fn(
            q[b, bos:eos], k[b, bos:eos], v[b, bos:eos], g[b, bos:eos], beta[b, bos:eos], S, offsets[n]
        )
        if checkpoint is not None:
            checkpoints[n] = checkpoint
    return o.to(out_dtype), final_state, checkpoints


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
    return _run(_recurrent_sequence, q, k, v, g, beta, scale, initial_state, cu_seqlens, checkpoint_offsets,
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
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor, Tensor | None]:
    return _run(partial(_chunk_sequence, chunk_size=chunk_size), q, k, v, g, beta, scale, initial_state,
                cu_seqlens, checkpoint_offsets, use_qk_l2norm_in_kernel)


def kda_decode(
    q: Tensor,  # [N, H, K]
    k: Tensor,  # [N, H, K]
    v: Tensor,  # [N, H, V]
    g: Tensor,  # [N, H, K]
    beta: Tensor,  # [N, H]
    state_pool: Tensor,  # [S, H, K, V], updated in place
    state_indices: Tensor,  # [N]
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
) -> Tensor:
    out_dtype = q.dtype
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float())
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    S, o = _step(state_pool[state_indices], q, k, v, g, beta)  # [N, H, K, V], [N, H, V]
    state_pool[state_indices] = S
    return o.to(out_dtype)


def kda_verify(
    q: Tensor,  # [T, H, K]: the verify rows of N sequences, packed
    k: Tensor,  # [T, H, K]
    v: Tensor,  # [T, H, V]
    g: Tensor,  # [T, H, K]
    beta: Tensor,  # [T, H]
    state_pool: Tensor,  # [S, H, K, V], read only
    state_indices: list[int],  # [N]
    cu_seqlens: list[int],  # [N+1]
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each sequence's tokens one decode step at a time, from its slot's state, which is left as it was; returns
    (o [T, H, V] in q.dtype, k_hat [T, H, K], u [T, H, V], g [T, H, K], all fp32 and of their own storage, never
    views of the inputs: they live until the commit, after the layer's activations are gone)."""
    out_dtype = q.dtype
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    u = torch.empty_like(o)
    k_hat = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    g32 = torch.empty_like(k_hat)  # g has k's shape
    for n, slot in enumerate(state_indices):
        S = state_pool[slot : slot + 1]  # [1, H, K, V]: a decode step's shape; updated out of place below
        for t in range(cu_seqlens[n], cu_seqlens[n + 1]):
            rows = slice(t, t + 1)  # prepared one row at a time, as a step: a vectorised op rounds by its length
            b = torch.sigmoid(beta[rows].float()) if use_beta_sigmoid_in_kernel else beta[rows]
            qt, k_hat[rows], vt, g32[rows], bt = _prepare(q[rows], k[rows], v[rows], g[rows], b, scale,
                                                          use_qk_l2norm_in_kernel)
            S, u[rows] = _update(S, k_hat[rows], vt, g32[rows], bt)
            o[rows] = torch.einsum("...hk,...hkv->...hv", qt, S)
    return o.to(out_dtype), k_hat, u, g32  # records own their memory: not views of the layer's tensors


def kda_commit(
    state_pool: Tensor,  # [S, H, K, V], updated in place
    k_hat: Tensor,  # [T, H, K] fp32, from kda_verify
    u: Tensor,  # [T, H, V] fp32
    g: Tensor,  # [T, H, K] fp32
    state_indices: list[int],  # [N]
    cu_seqlens: list[int],  # [N+1]
    commit_lens: list[int],  # [N], 0 <= commit_lens[n] <= its tokens
) -> None:
    """Fold the first commit_lens[n] verified tokens of sequence n into its slot, in forward order: the
    recurrence's own operations, so the slot ends bit-identical to the verify's running state there."""
    for n, (slot, length) in enumerate(zip(state_indices, commit_lens)):
        if length == 0:
            continue
        S = state_pool[slot : slot + 1]
        for t in range(cu_seqlens[n], cu_seqlens[n] + length):
            rows = slice(t, t + 1)
            S = _fold(S * g[rows].exp()[..., None], k_hat[rows], u[rows])
        state_pool[slot : slot + 1] = S
