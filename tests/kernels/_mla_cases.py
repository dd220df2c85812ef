"""The paged MLA decode case that the Triton kernel must match the torch reference on, shared by the GPU
test and the CPU test under the Triton interpreter."""

from __future__ import annotations

import torch
from torch import Tensor


def paged_decode_case(seq_lens: list[int], heads: int, L: int, R: int, block: int, dtype: torch.dtype,
                      device: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q_latent, q_pe, kv_cache, block_tables int32, seq_lens): a cache 2x larger than needed, NaN everywhere
    but the written rows (a stray read fails the test), shuffled blocks, tables padded with -1."""
    blocks = [-(-n // block) for n in seq_lens]
    num_blocks = 2 * sum(blocks) + 1
    kv = torch.full((num_blocks, block, L + R), float("nan"), device=device, dtype=dtype)
    order = torch.randperm(num_blocks, device=device)
    tables = torch.full((len(seq_lens), max(max(blocks), 1) + 1), -1, dtype=torch.int32, device=device)
    start = 0
    for n, (length, nb) in enumerate(zip(seq_lens, blocks)):
        tables[n, :nb] = order[start : start + nb].int()
        start += nb
        pos = torch.arange(length, device=device)
        kv[tables[n, pos // block].long(), pos % block] = torch.randn(length, L + R, device=device).to(dtype)
    q_latent = torch.randn(len(seq_lens), heads, L, device=device, dtype=dtype)
    q_pe = torch.randn(len(seq_lens), heads, R, device=device, dtype=dtype)
    return q_latent, q_pe, kv, tables, torch.tensor(seq_lens, device=device)
