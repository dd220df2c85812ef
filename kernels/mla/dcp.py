"""Decode context parallelism (DCP): the index math of a latent cache split by sequence over W ranks.

One block id names a virtual block of W pages of `page` tokens; DCP rank r stores page r of every block in its
own `[num_blocks, page, L + R]` tensor, so the tables are the same on every rank and rank r's tokens are
contiguous pages of them (docs/design/dcp.md):

    virtual block j       | page 0 | page 1 | ... | page W-1 |     W * page tokens
    held by DCP rank        0        1              W-1             at block j of its own tensor

Plain torch on the batch's device (no host read: a CUDA graph records it), the same on every backend.
"""

from __future__ import annotations

import torch
from torch import Tensor


def local_seq_lens(seq_lens: Tensor, page: int, dcp_size: int, dcp_rank: int) -> Tensor:
    """The tokens of each sequence's first seq_lens[n] that DCP rank `dcp_rank` holds: [N], seq_lens' dtype.
    n_r = sum_j clamp(n - j*W*page - r*page, 0, page); ranks differ by at most one page."""
    span = dcp_size * page
    return seq_lens // span * page + (seq_lens % span - dcp_rank * page).clamp(0, page)


def local_slots(slot_mapping: Tensor, page: int, dcp_size: int, dcp_rank: int) -> Tensor:
    """Virtual slots (block * W*page + offset; -1: none) as slots of rank `dcp_rank`'s tensor, -1 where another
    rank holds the token: [T] int64."""
    span = dcp_size * page
    offset = slot_mapping % span
    local = slot_mapping // span * page + offset % page
    mine = (slot_mapping >= 0) & (offset // page == dcp_rank)
    return torch.where(mine, local, torch.full_like(local, -1))


def shard_cache(kv_cache: Tensor, dcp_size: int) -> list[Tensor]:
    """A cache of virtual blocks [num_blocks, W*page, D] as its W ranks' tensors [num_blocks, page, D] (views)."""
    num_blocks, span, _ = kv_cache.shape
    if span % dcp_size:
        raise ValueError(f"blocks of {span} tokens do not split into {dcp_size} pages")
    page = span // dcp_size
    return [kv_cache[:, r * page : (r + 1) * page] for r in range(dcp_size)]


def interleave_pages(parts: Tensor) -> Tensor:
    """Every rank's copy of the same blocks [W, num_blocks, page, D] (rank r's page r of each) as those blocks'
    tokens in order: [num_blocks * W * page, D]."""
    W, num_blocks, page, D = parts.shape
    return parts.transpose(0, 1).reshape(num_blocks * W * page, D)


def split_decode(decode, merge, q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_tables: Tensor,
                 seq_lens: Tensor, scale: float, kv_lora_rank: int, dcp_size: int) -> tuple[Tensor, Tensor]:
    """W ranks' step in one process: each rank's `decode` over its pages of the virtual-block cache `kv_cache`
    [num_blocks, W*page, L+R], then `merge` of the W partial (o, lse). The decode and merge ops are given (the
    reference's or the dispatching ones), so the reference and the kernels run the same split."""
    page = kv_cache.shape[1] // dcp_size
    parts = [decode(q_latent, q_pe, shard.contiguous(), block_tables, local_seq_lens(seq_lens, page, dcp_size, r),
                    scale, kv_lora_rank)
             for r, shard in enumerate(shard_cache(kv_cache, dcp_size))]
    return merge(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
