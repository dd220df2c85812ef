"""Decode context parallelism's split + merge equals the unsplit MLA decode, and its index math puts every token on
exactly one rank: W = 2, 4, 8, pages of 4 and 64 tokens, lengths that leave shards empty, ragged and full."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels.mla import dcp, gather_kv_cache, mla_decode_dcp, mla_decode_paged, naive, write_kv_cache

from _close import assert_close

POISON = 1e30
H, R, L = 3, 8, 24
SCALE = 0.3
LENGTHS = [1, 63, 64, 65, 511, 1000, 0, 7]  # the design study's, an empty sequence and a short one


def _virtual_cache(seq_lens: list[int], span: int, gen: torch.Generator, poison: float = POISON):
    """(kv_cache [num_blocks, span, L+R] poisoned but for the written rows, block_tables int32 padded with -1,
    the latent rows written, their virtual slots): shuffled blocks, twice as many as needed."""
    blocks = [-(-n // span) for n in seq_lens]
    num_blocks = 2 * sum(blocks) + 1
    kv = torch.full((num_blocks, span, L + R), poison)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(blocks) + 1), -1, dtype=torch.int32)
    slots, start = [], 0
    for n, (length, nb) in enumerate(zip(seq_lens, blocks)):
        tables[n, :nb] = torch.tensor(order[start : start + nb], dtype=torch.int32)
        start += nb
        slots += [int(tables[n, p // span]) * span + p % span for p in range(length)]
    latent = torch.randn(sum(seq_lens), L + R, generator=gen)
    slots = torch.tensor(slots, dtype=torch.int64)
    write_kv_cache(kv, slots, latent)
    return kv, tables, latent, slots


@pytest.mark.parametrize("dcp_size,page", [(2, 4), (2, 64), (4, 4), (4, 64), (8, 8)],
                         ids=lambda v: str(v))
def test_split_and_merge_equals_the_unsplit_decode(dcp_size: int, page: int) -> None:
    gen = torch.Generator().manual_seed(dcp_size * 100 + page)
    kv, tables, _, _ = _virtual_cache(LENGTHS, dcp_size * page, gen)
    q_latent = torch.randn(len(LENGTHS), H, L, generator=gen)
    q_pe = torch.randn(len(LENGTHS), H, R, generator=gen)
    lens = torch.tensor(LENGTHS)
    ref_o, ref_lse = mla_decode_paged(q_latent, q_pe, kv, tables, lens, SCALE, L)
    for split in (naive.mla_decode_dcp, mla_decode_dcp):
        o, lse = split(q_latent, q_pe, kv, tables, lens, SCALE, L, dcp_size)
        assert_close("o_latent", ref_o, o, atol=1e-5, rtol=1e-5)
        full = lens > 0
        assert_close("lse", ref_lse[full], lse[full], atol=1e-5, rtol=1e-6)
        assert torch.isinf(lse[~full]).all() and (o[~full] == 0).all()


@pytest.mark.parametrize("dcp_size,page", [(2, 4), (4, 8)], ids=lambda v: str(v))
def test_each_token_is_written_on_exactly_one_rank_and_gathers_back_in_order(dcp_size: int, page: int) -> None:
    """Every rank writes the batch through `local_slots` into its own poisoned tensor: the rows it holds are its
    pages of the virtual cache, all others stay poisoned, and the ranks' blocks interleaved are the tokens."""
    gen = torch.Generator().manual_seed(7)
    seq_lens = [5, 33, 17]
    kv, tables, latent, slots = _virtual_cache(seq_lens, dcp_size * page, gen)
    written = torch.zeros(kv.shape[:2], dtype=torch.bool)
    written.view(-1)[slots] = True
    ranks = []
    for r, shard in enumerate(dcp.shard_cache(kv, dcp_size)):
        mine = torch.full(shard.shape, POISON)
        write_kv_cache(mine, dcp.local_slots(slots, page, dcp_size, r), latent)
        held = written[:, r * page : (r + 1) * page]
        assert torch.equal(mine[held], shard[held]) and (mine[~held] == POISON).all()
        ranks.append(mine)
    assert sum(int(dcp.local_seq_lens(torch.tensor(seq_lens), page, dcp_size, r).sum()) for r in range(dcp_size)) \
        == sum(seq_lens)
    packed, _ = gather_kv_cache(kv, tables, torch.tensor(seq_lens))
    for n, length in enumerate(seq_lens):
        ids = tables[n, : -(-length // (dcp_size * page))].long()
        tokens = dcp.interleave_pages(torch.stack([t[ids] for t in ranks]))[:length]
        assert torch.equal(tokens, packed[sum(seq_lens[:n]) : sum(seq_lens[: n + 1])])


def test_local_lengths_differ_by_at_most_one_page() -> None:
    lens = torch.arange(0, 300)
    parts = torch.stack([dcp.local_seq_lens(lens, 8, 4, r) for r in range(4)])
    assert torch.equal(parts.sum(0), lens) and (parts.amax(0) - parts.amin(0) <= 8).all()
    assert (parts[:-1] >= parts[1:]).all()  # earlier ranks fill first


def test_a_block_that_does_not_split_into_pages_is_refused() -> None:
    kv = torch.zeros(2, 6, L + R)
    with pytest.raises(ValueError, match="dcp_size=4 must be >= 1 and divide"):
        mla_decode_dcp(torch.zeros(1, H, L), torch.zeros(1, H, R), kv, torch.zeros(1, 1, dtype=torch.int32),
                       torch.tensor([1]), SCALE, L, 4)
