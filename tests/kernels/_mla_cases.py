"""The paged MLA decode cases that the Triton kernel must match the torch reference on, shared by the GPU
test and the CPU test under the Triton interpreter."""

from __future__ import annotations

import torch
from torch import Tensor

from _close import assert_rel_rms


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


def check_decode_takes_layer_queries(L: int, R: int, block: int, scale: float, dtype: torch.dtype, device: str,
                                     tol: float, lse_tol: float) -> None:
    """The queries as the MLA layer passes them, with no copy: q_latent fp32 (W_UK's product), q_pe a column
    slice of the wider q rows (head stride nope + R), int64 tables. The kernel rounds the queries to the cache
    dtype as it loads them, so it matches the reference on the rounded queries, in one split and in two (the
    merge), and o_latent comes out in q_latent's dtype (fp32)."""
    from k3serve.kernels.mla import naive, triton_decode

    seq_lens, heads, nope = [40, 1, 0, 100], 4, 48
    _, _, kv, tables, lens = paged_decode_case(seq_lens, heads, L, R, block, dtype, device)
    q_latent = torch.randn(len(seq_lens), heads, L, device=device)
    q_pe = torch.randn(len(seq_lens), heads, nope + R, device=device).to(dtype)[..., nope:]
    tables = tables.long()
    ref_o, ref_lse = naive.mla_decode_paged(q_latent.to(dtype).float(), q_pe, kv, tables, lens, scale, L)
    full = lens > 0
    for num_splits in (1, 2):
        o, lse = triton_decode.mla_decode_paged(q_latent, q_pe, kv, tables, lens, scale, max(seq_lens), num_splits)
        assert o.dtype == torch.float32 and lse.dtype == torch.float32, num_splits
        assert_rel_rms(f"o_latent, {num_splits} split(s)", ref_o, o, tol)
        assert (lse[full] - ref_lse[full]).abs().max() < lse_tol and torch.isinf(lse[~full]).all(), num_splits
        assert (o[~full] == 0).all(), num_splits
