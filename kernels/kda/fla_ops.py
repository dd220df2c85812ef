"""KDA prefill on the GPU through fla (fla-core 0.6.0): chunked, with in-pass checkpoints (decode is our own
Triton step, triton_decode.py). Inputs arrive validated from `kernels.kda`, with a `ChunkPlan` (chunk_plan.py)
holding every index on the device already; layouts are fla's ([K, V] states).

Prefill re-assembles fla's inference forward (fla/ops/kda/chunk_fwd.py) from its stages, keeping what a
mid-chunk checkpoint needs (the keys, the in-chunk gate cumsum, v_new); checkpoints (triton_checkpoint.py) are
the chunk-start state h[j] advanced by the m tokens of chunk j before the offset. With or without checkpoints the
same kernels run (one autotune) and nothing reads a device value back. The stages, and the precision of a
checkpoint: docs/design/kda_fla_prefill.md.
"""

from __future__ import annotations

import torch
import triton
from fla.modules.norm.l2norm import l2norm_fwd
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64
from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
from fla.ops.utils import chunk_local_cumsum
from fla.ops.utils.constant import RCP_LN2
from torch import Tensor

from .._backend import device_of
from .chunk_plan import ChunkPlan
from .triton_checkpoint import checkpoint_states

DTYPES = (torch.bfloat16, torch.float16)


def _head_dims_ok(K: int, V: int) -> bool:
    """The head sizes fla's KDA kernels are built and tested for (Kimi: 128); tiny CPU test models
    (head_dim 16) stay on the reference."""
    return 64 <= K <= 256 and 64 <= V <= 256


def supports_chunk(q: Tensor, v: Tensor, chunk_size: int) -> bool:
    return q.dtype in DTYPES and chunk_size in (32, 64) and _head_dims_ok(q.shape[-1], v.shape[-1])


@torch.no_grad()
def chunk_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None, initial_state: Tensor | None,
    plan: ChunkPlan, use_qk_l2norm_in_kernel: bool, chunk_size: int, safe_gate: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """fla's chunked forward, one pass. safe_gate: g is known to lie in [-5, 0) (K3 bounded gate), which
    lets fla use its tensor-core intra-chunk path."""
    B, T, H, K = q.shape
    V, BT = v.shape[-1], chunk_size
    scale = K**-0.5 if scale is None else scale
    cu, chunk_indices = plan.cu_seqlens, plan.chunk_indices
    with device_of(q):
        q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
        if use_qk_l2norm_in_kernel:
            q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
        gc = chunk_local_cumsum(g.contiguous().float(), chunk_size=BT, scale=RCP_LN2, cu_seqlens=cu,
                                chunk_indices=chunk_indices)
        w, u, _, kg, Aqk, _ = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=gc, beta=beta, scale=scale, cu_seqlens=cu,
                                                  chunk_size=BT, chunk_indices=chunk_indices, safe_gate=safe_gate)
        h = k.new_empty(B, plan.num_chunks // B, H, K, V)
        final_state = q.new_empty(plan.num_seqs, H, K, V, dtype=torch.float32)
        v_new = torch.empty_like(u)

        def grid(meta):
            return (triton.cdiv(V, meta["BV"]) * plan.num_seqs * H,)

        chunk_gated_delta_rule_fwd_kernel_h_blockdim64[grid](
            k=kg, v=u, w=w, v_new=v_new, g=None, gk=gc, h=h, h0=initial_state, ht=final_state,
            cu_seqlens=cu, chunk_offsets=plan.chunk_offsets, T=T, H=H, HV=H, K=K, V=V, BT=BT,
            STATE_V_FIRST=False,
        )
        o = chunk_gla_fwd_o_gk(q=q, v=v_new, g=gc, A=Aqk, h=h, scale=scale, cu_seqlens=cu, chunk_size=BT,
                               chunk_indices=chunk_indices)
        checkpoints = None
        if plan.checkpoints is not None:  # every row written by the kernel, zeros included
            checkpoints = final_state.new_empty(plan.num_seqs, H, K, V)
            checkpoint_states(h, k, gc, v_new, plan.checkpoints, checkpoints, BT)
    return o.to(q.dtype), final_state, checkpoints
