"""The MLA layer's decode context parallel step: one rank's part of attention over a latent cache split by
sequence across its DCP group (`TensorParallel.dcp_size` ranks; `kernels/mla/dcp.py` draws the layout).

    decode / verify rows   q [N, H, L+R] -> all-gather (DCP) -> [N, W*H, L+R]
                           local paged decode over this rank's pages -> o [N, W*H, L] fp32, lse [N, W*H]
                           all-to-all: heads of DCP rank s to rank s -> [W, N, H, L+1] -> LSE merge -> [N, H, L]
    prefill context        this rank's pages of the sequences' blocks -> all-gather -> interleaved in order

Every rank computes every new token's latent (kv_a_proj is replicated) and writes only its own pages.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3serve.kernels.mla import dcp, merge_attn_states, mla_decode_paged
from k3serve.model.parallel import TensorParallel


def decode(tp: TensorParallel, q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_tables: Tensor,
           seq_lens: Tensor, scale: float, kv_lora_rank: int) -> Tensor:
    """One query row a sequence over its first seq_lens[n] tokens (all DCP ranks' pages): o_latent [N, H, L] fp32
    for this rank's heads. q_latent [N, H, L] fp32, q_pe [N, H, R]; block_tables [N, max_blocks] of virtual
    blocks, the same on every rank."""
    N, H, L = q_latent.shape
    W = tp.dcp_size
    q = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1)  # [N, H, L+R]; widening q_pe is exact
    q_all = tp.dcp_all_gather(q).permute(1, 0, 2, 3).reshape(N, W * H, q.shape[-1])  # the group's heads
    lens = dcp.local_seq_lens(seq_lens, kv_cache.shape[1], W, tp.dcp_rank)
    o, lse = mla_decode_paged(q_all[..., :L], q_all[..., L:], kv_cache, block_tables, lens, scale, kv_lora_rank)
    parts = torch.cat([o.float(), lse.unsqueeze(-1)], dim=-1).view(N, W, H, L + 1).transpose(0, 1)
    got = tp.dcp_all_to_all(parts)  # [W, N, H, L+1]: each rank's part for this rank's heads
    o_latent, _ = merge_attn_states(got[..., :L], got[..., L])
    return o_latent


def verify(tp: TensorParallel, q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_tables: Tensor,
           seq_lens: list[int], cu_q: list[int], scale: float, kv_lora_rank: int) -> Tensor:
    """The verify rows (`mla_verify_paged`'s arguments): row i of a sequence of q_len rows is the decode of its
    first seq_len - (q_len - 1 - i) tokens, so each row is a decode row with its own causal limit, whose local
    part is that limit's share on this rank. Returns o_latent [T, H, L] fp32."""
    q_lens = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    row_lens = [n - (q - 1 - i) for n, q in zip(seq_lens, q_lens) for i in range(q)]
    rows = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens)).to(block_tables.device)
    lens = torch.tensor(row_lens, dtype=torch.int64).to(q_latent.device)
    return decode(tp, q_latent, q_pe, kv_cache, block_tables[rows], lens, scale, kv_lora_rank)


def gather_context(tp: TensorParallel, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor
                   ) -> tuple[Tensor, Tensor]:
    """`gather_kv_cache` of a cache split over the DCP group: (packed [sum(seq_lens), L+R], cu_seqlens int64 [N+1]
    on the host). seq_lens on the host; every rank of the group gathers the same blocks, its own pages of them."""
    span = tp.dcp_size * kv_cache.shape[1]
    lens = seq_lens.tolist()
    used = [-(-n // span) for n in lens]
    ids = torch.cat([block_tables[n, :k] for n, k in enumerate(used)]).long()
    tokens = dcp.interleave_pages(tp.dcp_all_gather(kv_cache[ids]))  # [sum(used) * span, L+R]
    starts = torch.tensor([0, *used[:-1]]).cumsum(0) * span
    keep = torch.cat([torch.arange(n) + s for n, s in zip(lens, starts.tolist())]).to(tokens.device)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return tokens[keep], cu
