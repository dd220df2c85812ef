"""KDA on the GPU through fla (fla-core 0.6.0): chunked prefill with fp32 in-pass checkpoints, and
pooled decode. Inputs arrive validated from `kernels.kda`; layouts are fla's ([K, V] states).

Prefill re-assembles fla's inference forward (fla/ops/kda/chunk_fwd.py) from its stages, so that the
per-chunk states can stay fp32 when checkpoints are asked for (fla's own call stores them as bf16):

    l2norm(q, k) -> chunk-local cumsum of g (log2 units) -> intra-chunk WY (w, u, kg, Aqk)
    -> h kernel: h[c] = state at the START of chunk c (fp32 if checkpoints, else bf16), v_new, final
    -> output kernel (reads h, rounds it to bf16 for its dot, as fla does)

A checkpoint at offset p of a sequence (chunk j = (p-1) // C, m = p - C*j tokens into it) is the exact
mid-chunk state, from the same pass (the triangular solve makes v_new of a prefix the prefix's own):

    S_p = exp2(G_m) ⊙ h[j] + Σ_{i<m} (exp2(G_m - G_i) ⊙ k_i) v_new_i^T    (G: in-chunk cumsum, log2)

which is `naive._advance`. Decode calls fla's fused_recurrent_kda_fwd on the slot pool in place.
"""

from __future__ import annotations

import torch
import triton
from fla.modules.norm.l2norm import l2norm_fwd
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64
from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices, prepare_chunk_offsets
from fla.ops.utils.constant import RCP_LN2
from torch import Tensor

from .._backend import device_of

DTYPES = (torch.bfloat16, torch.float16)


def _head_dims_ok(K: int, V: int) -> bool:
    """The head sizes fla's KDA kernels are built and tested for (Kimi: 128); tiny CPU test models
    (head_dim 16) stay on the reference."""
    return 64 <= K <= 256 and 64 <= V <= 256


def supports_chunk(q: Tensor, v: Tensor, chunk_size: int) -> bool:
    return q.dtype in DTYPES and chunk_size in (32, 64) and _head_dims_ok(q.shape[-1], v.shape[-1])


def supports_decode(q: Tensor, v: Tensor, state_pool: Tensor) -> bool:
    H, K, V = state_pool.shape[1:]
    return q.dtype in DTYPES and _head_dims_ok(K, V) and state_pool.stride()[1:] == (K * V, V, 1)


def _checkpoints(h: Tensor, k: Tensor, gc: Tensor, v_new: Tensor, offsets: list[int], row_starts: list[int],
                 chunk_bases: list[int], chunk_size: int) -> Tensor:
    """States after offsets[n] tokens (0 where -1): h [B*NT, H, K, V] fp32; k, gc [B*T, H, K]; v_new [B*T, H, V]."""
    N, (H, K, V) = len(offsets), h.shape[1:]
    out = h.new_zeros(N, H, K, V)
    wanted = [n for n, p in enumerate(offsets) if p > 0]
    if not wanted:
        return out
    dev = h.device
    j = torch.tensor([(offsets[n] - 1) // chunk_size for n in wanted])  # chunk holding the offset
    m = torch.tensor([offsets[n] for n in wanted]) - j * chunk_size  # tokens of that chunk before it, 1..C
    tok0 = torch.tensor([row_starts[n] for n in wanted]) + j * chunk_size
    h_idx = (torch.tensor([chunk_bases[n] for n in wanted]) + j).to(dev)
    i = torch.arange(chunk_size)
    tok = (tok0[:, None] + i).clamp(max=k.shape[0] - 1).to(dev)  # [W, C]
    keep = (i[None, :] < m[:, None]).to(dev)  # [W, C]
    last = (tok0 + m - 1).to(dev)  # [W]
    G_last = gc[last]  # [W, H, K]
    expo = torch.where(keep[..., None, None], G_last[:, None] - gc[tok], float("-inf"))  # [W, C, H, K]
    k_decayed = torch.exp2(expo) * k[tok].float()
    v_kept = torch.where(keep[..., None, None], v_new[tok].float(), 0.0)  # [W, C, H, V]
    S = torch.exp2(G_last)[..., None] * h[h_idx] + torch.einsum("wchk,wchv->whkv", k_decayed, v_kept)
    out[torch.tensor(wanted, device=dev)] = S
    return out


@torch.no_grad()
def chunk_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, checkpoint_offsets: Tensor | None, use_qk_l2norm_in_kernel: bool, chunk_size: int,
    safe_gate: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """fla's chunked forward, one pass. safe_gate: g is known to lie in [-5, 0) (K3 bounded gate), which
    lets fla use its tensor-core intra-chunk path."""
    B, T, H, K = q.shape
    V, BT = v.shape[-1], chunk_size
    scale = K**-0.5 if scale is None else scale
    with device_of(q):
        q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
        if use_qk_l2norm_in_kernel:
            q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
        chunk_indices = None if cu_seqlens is None else prepare_chunk_indices(cu_seqlens, BT)
        gc = chunk_local_cumsum(g.contiguous().float(), chunk_size=BT, scale=RCP_LN2, cu_seqlens=cu_seqlens,
                                chunk_indices=chunk_indices)
        w, u, _, kg, Aqk, _ = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=gc, beta=beta, scale=scale, cu_seqlens=cu_seqlens,
                                                  chunk_size=BT, chunk_indices=chunk_indices, safe_gate=safe_gate)
        if cu_seqlens is None:
            N, NT, chunk_offsets = B, triton.cdiv(T, BT), None
        else:
            N, NT = cu_seqlens.numel() - 1, chunk_indices.shape[0]
            chunk_offsets = prepare_chunk_offsets(cu_seqlens, BT)
        h_dtype = torch.float32 if checkpoint_offsets is not None else k.dtype
        h = k.new_empty(B, NT, H, K, V, dtype=h_dtype)
        final_state = q.new_empty(N, H, K, V, dtype=torch.float32)
        v_new = torch.empty_like(u)

        def grid(meta):
            return (triton.cdiv(V, meta["BV"]) * N * H,)

        chunk_gated_delta_rule_fwd_kernel_h_blockdim64[grid](
            k=kg, v=u, w=w, v_new=v_new, g=None, gk=gc, h=h, h0=initial_state, ht=final_state,
            cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, T=T, H=H, HV=H, K=K, V=V, BT=BT,
            STATE_V_FIRST=False,
        )
        o = chunk_gla_fwd_o_gk(q=q, v=v_new, g=gc, A=Aqk, h=h, scale=scale, cu_seqlens=cu_seqlens, chunk_size=BT,
                               chunk_indices=chunk_indices)
        checkpoints = None
        if checkpoint_offsets is not None:
            if cu_seqlens is None:
                row_starts, chunk_bases = [n * T for n in range(N)], [n * NT for n in range(N)]
            else:
                row_starts, chunk_bases = cu_seqlens[:-1].tolist(), chunk_offsets[:-1].tolist()
            checkpoints = _checkpoints(h.flatten(0, 1), k.flatten(0, 1), gc.flatten(0, 1), v_new.flatten(0, 1),
                                       checkpoint_offsets.tolist(), row_starts, chunk_bases, BT)
    return o.to(q.dtype), final_state, checkpoints


@torch.no_grad()
def kda_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, state_indices: Tensor,
               scale: float | None, use_qk_l2norm_in_kernel: bool) -> Tensor:
    """One token per sequence as B = N rows of T = 1; the pool is read and written in place."""
    with device_of(q):
        o, _ = fused_recurrent_kda_fwd(
            q=q.unsqueeze(1).contiguous(), k=k.unsqueeze(1).contiguous(), v=v.unsqueeze(1).contiguous(),
            g=g.unsqueeze(1).contiguous(), beta=beta.unsqueeze(1).contiguous(), initial_state=state_pool,
            scale=scale, inplace_final_state=True, ssm_state_indices=state_indices,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
    return o.squeeze(1)
