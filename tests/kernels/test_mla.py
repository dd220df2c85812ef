"""MLA reference: paged cache round trip under poison, absorbed decode == MHA form, LSE merge, chunked prefill."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels.mla import (
    gather_kv_cache,
    merge_attn_states,
    mla_decode_paged,
    mla_prefill_attention,
    write_kv_cache,
)

from _close import assert_close

# A poisoned row c = ±1e30 gives a score of ±1e31-ish: a positive one blows up lse and o, a negative one
# is silently ignored by softmax. Running the poison test with both signs makes any stray read fail.
POISON = 1e30
H, P, R, L, DV = 3, 16, 8, 24, 12  # heads, nope, rope, kv_lora_rank, v_head (small, uneven)
SCALE = (P + R) ** -0.5


def _paged_pool(
    seq_lens: list[int], block_size: int, gen: torch.Generator, poison: float = POISON
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool 3x larger than needed, poisoned with `poison`; each sequence gets shuffled blocks, table padded with -1.

    Returns (kv_cache, block_tables int32, latent [sum(seq_lens), L+R] written through write_kv_cache)."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 3 * sum(blocks_per_seq) + 1
    kv_cache = torch.full((num_blocks, block_size, L + R), poison)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    latent = torch.randn(sum(seq_lens), L + R, generator=gen)
    slots, start = [], 0
    for n, (length, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[n, :nb] = torch.tensor(order[start : start + nb], dtype=torch.int32)
        start += nb
        slots += [int(block_tables[n, p // block_size]) * block_size + p % block_size for p in range(length)]
    write_kv_cache(kv_cache, torch.tensor(slots, dtype=torch.int64), latent)
    return kv_cache, block_tables, latent


def _plain_attention(q_latent, q_pe, kv, scale):
    """softmax((q_latent·c + q_pe·k_pe) scale) c over one sequence's tokens kv [S, L+R]; (o [H, L], lse [H])."""
    s = (q_latent @ kv[:, :L].T + q_pe @ kv[:, L:].T) * scale
    return torch.softmax(s, -1) @ kv[:, :L], torch.logsumexp(s, -1)


def test_write_skips_minus_one_and_gather_round_trips() -> None:
    gen = torch.Generator().manual_seed(0)
    kv_cache, block_tables, latent = _paged_pool([5, 1, 9], 4, gen)
    before = kv_cache.clone()
    write_kv_cache(kv_cache, torch.tensor([-1, -1]), torch.zeros(2, L + R))
    assert torch.equal(kv_cache, before)
    packed, cu_seqlens = gather_kv_cache(kv_cache, block_tables, torch.tensor([5, 1, 9]))
    assert cu_seqlens.tolist() == [0, 5, 6, 15] and cu_seqlens.dtype == torch.int64
    assert torch.equal(packed, latent)


@pytest.mark.parametrize("poison", [POISON, -POISON], ids=["pos", "neg"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_poisoned_pool_equals_plain_attention(block_size: int, poison: float) -> None:
    gen = torch.Generator().manual_seed(block_size)
    seq_lens = [7, 1, 13, 4]
    kv_cache, block_tables, latent = _paged_pool(seq_lens, block_size, gen, poison)
    q_latent, q_pe = torch.randn(4, H, L, generator=gen), torch.randn(4, H, R, generator=gen)
    o, lse = mla_decode_paged(q_latent, q_pe, kv_cache, block_tables, torch.tensor(seq_lens), SCALE, L)
    assert o.shape == (4, H, L) and lse.shape == (4, H) and lse.dtype == torch.float32
    bounds = [0, 7, 8, 21, 25]
    for n in range(4):
        o_ref, lse_ref = _plain_attention(q_latent[n], q_pe[n], latent[bounds[n] : bounds[n + 1]], SCALE)
        assert_close(f"o[{n}]", o_ref, o[n], 1e-5, 1e-5)
        assert_close(f"lse[{n}]", lse_ref, lse[n], 1e-5, 1e-5)


@pytest.mark.parametrize("block_size", [4, 5])
def test_absorbed_decode_equals_mha_mla(block_size: int) -> None:
    """Absorbed: q_latent = q_nope W_UK, o = o_latent W_UV. MHA: [k_nope | v] = c W_kv_b, k = [k_nope | k_pe]."""
    gen = torch.Generator().manual_seed(10 + block_size)
    seq_lens = [1, 6, 11]
    kv_cache, block_tables, latent = _paged_pool(seq_lens, block_size, gen)
    w_kv_b = torch.randn(L, H, P + DV, generator=gen) / L**0.5  # kv_b_proj as c @ W: [L, H*(P+DV)]
    w_uk, w_uv = w_kv_b[..., :P], w_kv_b[..., P:]  # [L, H, P], [L, H, DV]
    q = torch.randn(len(seq_lens), H, P + R, generator=gen)  # the last token's query per sequence
    q_nope, q_pe = q[..., :P], q[..., P:]

    q_latent = torch.einsum("nhp,lhp->nhl", q_nope, w_uk)
    o_latent, _ = mla_decode_paged(q_latent, q_pe, kv_cache, block_tables, torch.tensor(seq_lens), SCALE, L)
    o_absorbed = torch.einsum("nhl,lhv->nhv", o_latent, w_uv)

    c, k_pe = latent[:, :L], latent[:, L:]
    kv = torch.einsum("tl,lhd->thd", c, w_kv_b)  # [T, H, P+DV]
    k = torch.cat([kv[..., :P], k_pe[:, None, :].expand(-1, H, -1)], dim=-1)
    cu_k = torch.tensor([0, 1, 7, 18])
    o_mha = mla_prefill_attention(q, k, kv[..., P:].contiguous(), torch.arange(4), cu_k, SCALE)
    assert_close("absorbed_vs_mha", o_mha, o_absorbed, 1e-5, 1e-4)


def test_split_keys_and_merge_equals_one_pass() -> None:
    gen = torch.Generator().manual_seed(20)
    seq_lens = [9, 3, 14]
    kv_cache, block_tables, _ = _paged_pool(seq_lens, 4, gen)
    q_latent, q_pe = torch.randn(3, H, L, generator=gen), torch.randn(3, H, R, generator=gen)
    o_full, lse_full = mla_decode_paged(q_latent, q_pe, kv_cache, block_tables, torch.tensor(seq_lens), SCALE, L)
    # Part 0: the first 2 blocks (8 tokens) of each sequence; part 1: the rest (sequence 1 fits in part 0).
    head_lens = torch.tensor([min(n, 8) for n in seq_lens])
    o0, lse0 = mla_decode_paged(q_latent, q_pe, kv_cache, block_tables[:, :2], head_lens, SCALE, L)
    o1, lse1 = mla_decode_paged(
        q_latent, q_pe, kv_cache, block_tables[:, 2:], torch.tensor(seq_lens) - head_lens, SCALE, L
    )
    assert torch.isneginf(lse1[1]).all() and (o1[1] == 0).all()  # empty part
    o, lse = merge_attn_states(torch.stack([o0, o1]), torch.stack([lse0, lse1]))
    assert_close("merged_o", o_full, o, 1e-5, 1e-5)
    assert_close("merged_lse", lse_full, lse, 1e-5, 1e-5)


def test_merge_all_empty_and_garbage_parts() -> None:
    outputs = torch.full((2, 1, 2, 4), float("nan"))
    outputs[0, 0, 0] = 3.0
    lses = torch.full((2, 1, 2), float("-inf"))
    lses[0, 0, 0] = 0.7  # head 0: one live part; head 1: nothing anywhere
    o, lse = merge_attn_states(outputs, lses)
    assert (o[0, 0] == 3.0).all() and lse[0, 0].item() == pytest.approx(0.7)
    assert (o[0, 1] == 0).all() and torch.isneginf(lse[0, 1])
    assert not torch.isnan(o).any()


def test_chunked_prefill_is_last_rows_of_full_causal() -> None:
    """Prefill the last 3 of 10 tokens (plus a second sequence of 4 in full) == rows of one causal pass."""
    gen = torch.Generator().manual_seed(30)
    q, k = torch.randn(14, H, P + R, generator=gen), torch.randn(14, H, P + R, generator=gen)
    v = torch.randn(14, H, DV, generator=gen)
    cu_full = torch.tensor([0, 10, 14])
    full = mla_prefill_attention(q, k, v, cu_full, cu_full, SCALE)
    rows = torch.tensor([7, 8, 9, 10, 11, 12, 13])
    chunk = mla_prefill_attention(q[rows], k, v, torch.tensor([0, 3, 7]), cu_full, SCALE)
    assert_close("chunked_prefill", full[rows], chunk, 1e-6, 1e-6)
    # Row 0 of a full pass sees only key 0, so it returns v[0].
    assert_close("first_row", v[0], full[0], 1e-6, 1e-6)
    out_bf16 = mla_prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_full, cu_full, SCALE)
    assert out_bf16.dtype == torch.bfloat16


def test_fused_sdpa_prefill_equals_the_reference() -> None:
    """The CUDA path's SDPA prefill (run here on CPU tensors): chunks over cached prefixes (queries are the LAST of
    their keys: bottom-right causal), a whole prompt, a one-token chunk, v narrower than q/k (zero-padded)."""
    from k3serve.kernels.mla import naive, sdpa_prefill

    gen = torch.Generator().manual_seed(31)
    bounds_q, bounds_k = [0, 3, 7, 8], [0, 10, 14, 23]  # chunk of 3 over 7 cached, a whole 4, 1 over 8 cached
    q = torch.randn(8, H, P + R, generator=gen)
    k, v = torch.randn(23, H, P + R, generator=gen), torch.randn(23, H, DV, generator=gen)
    ref = naive.mla_prefill_attention(q, k, v, torch.tensor(bounds_q), torch.tensor(bounds_k), SCALE)
    assert_close("sdpa prefill", ref, sdpa_prefill.mla_prefill_attention(q, k, v, bounds_q, bounds_k, SCALE), 1e-5, 1e-5)


def test_validation() -> None:
    kv_cache = torch.zeros(4, 4, L + R)
    with pytest.raises(ValueError, match="block_tables\\[0\\]"):
        gather_kv_cache(kv_cache, torch.tensor([[-1, 2]], dtype=torch.int32), torch.tensor([3]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(kv_cache, torch.tensor([16]), torch.zeros(1, L + R))
    q = torch.zeros(5, H, P + R)
    with pytest.raises(ValueError, match="q_len <= k_len"):
        mla_prefill_attention(q, q[:3], torch.zeros(3, H, DV), torch.tensor([0, 5]), torch.tensor([0, 3]), SCALE)
