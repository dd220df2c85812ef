"""Specification: the verify kernels of speculative decoding (reference path, CPU fp32).

- `kda_verify` over 1 + k tokens a sequence gives the outputs of k + 1 consecutive `kda_decode` steps and leaves
  the pool byte-identical; `kda_commit` of any accepted length n (0..k+1) leaves the slot bit-identical to the
  state after recomputing exactly those n tokens (`recurrent_kda` and `kda_decode` alike), other slots untouched.
- `conv_verify` / `conv_commit`: the same for the short conv's outputs and windows.
- `mla_verify_paged`: row i of a sequence equals `mla_decode_paged` over its first seq_len - (q_len - 1 - i) keys,
  bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels.conv import causal_conv1d, conv_commit, conv_verify
from k3serve.kernels.kda import kda_commit, kda_decode, kda_verify, recurrent_kda
from k3serve.kernels.mla import mla_decode_paged, mla_verify_paged

H, D, SLOTS, W, C = 2, 8, 6, 4, 12
POISON = 1e30


def _tokens(gen: torch.Generator, T: int) -> tuple[torch.Tensor, ...]:
    q, k, v = (torch.randn(T, H, D, generator=gen) for _ in range(3))
    g = -torch.rand(T, H, D, generator=gen) * 2  # log decay < 0
    beta_logits = torch.randn(T, H, generator=gen)
    return q, k, v, g, beta_logits


def _pool(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(SLOTS, H, D, D, generator=gen)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_kda_verify_is_k_plus_1_decode_steps_and_reads_the_pool_only(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    slots, lens = [4, 1], [k + 1, 2]
    cu = [0, lens[0], sum(lens)]
    q, kk, v, g, b = _tokens(gen, cu[-1])
    pool = _pool(gen)
    before = pool.clone()
    o, _ = kda_verify(q, kk, v, g, b, pool, slots, cu, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert torch.equal(pool, before), "the verify pass wrote the pool"
    stepped = before.clone()
    for n, slot in enumerate(slots):
        for t in range(cu[n], cu[n + 1]):
            rows = slice(t, t + 1)
            want = kda_decode(q[rows], kk[rows], v[rows], g[rows], b[rows], stepped, torch.tensor([slot]),
                              use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
            assert torch.equal(o[rows], want), f"sequence {n} token {t - cu[n]}"


@pytest.mark.parametrize("k", [1, 4, 8])
def test_kda_commit_of_every_accepted_length_is_the_recomputed_state_bit_for_bit(k: int) -> None:
    gen = torch.Generator().manual_seed(100 + k)
    q, kk, v, g, b = _tokens(gen, k + 1)
    pool = _pool(gen)
    pool[0] = POISON  # another request's slot: never read, never written
    _, records = kda_verify(q, kk, v, g, b, pool, [3], [0, k + 1], use_qk_l2norm_in_kernel=True,
                            use_beta_sigmoid_in_kernel=True)
    for n in range(k + 2):
        committed = pool.clone()
        kda_commit(committed, records, [3], [0, k + 1], [n])
        stepped = pool.clone()  # n consecutive decode steps of the accepted tokens
        for t in range(n):
            kda_decode(q[t : t + 1], kk[t : t + 1], v[t : t + 1], g[t : t + 1], b[t : t + 1], stepped,
                       torch.tensor([3]), use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        assert torch.equal(committed, stepped), f"accepted length {n}: commit != recompute"
        if n:
            _, final, _ = recurrent_kda(q[None, :n], kk[None, :n], v[None, :n], g[None, :n],
                                        torch.sigmoid(b[None, :n]), initial_state=pool[3:4],
                                        use_qk_l2norm_in_kernel=True)
            assert torch.equal(committed[3], final[0]), f"accepted length {n}: commit != recurrent_kda"
        assert torch.equal(committed[torch.arange(SLOTS) != 3], pool[torch.arange(SLOTS) != 3])


def test_conv_verify_reads_the_window_and_commit_moves_it_by_the_accepted_tokens() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(C, W, generator=gen)
    x = torch.randn(6, C, generator=gen)
    state = torch.randn(SLOTS, C, W - 1, generator=gen)
    before = state.clone()
    y = conv_verify(x, weight, state, [0, 6], [2])
    assert torch.equal(state, before)
    for n in range(7):
        stepped = before.clone()
        for t in range(n):
            want = causal_conv1d(x[t : t + 1], weight, stepped, torch.tensor([0, 1]), torch.tensor([2]))
            assert torch.equal(y[t : t + 1], want)
        committed = before.clone()
        conv_commit(committed, x, [0, 6], [2], [n])
        assert torch.equal(committed, stepped), f"accepted length {n}"


def test_mla_verify_rows_are_decodes_of_their_causal_lengths() -> None:
    gen = torch.Generator().manual_seed(3)
    L, R, block = 16, 4, 4
    cache = torch.randn(10, block, L + R, generator=gen)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 8]], dtype=torch.int32)
    seq_lens, cu = [11, 6], [0, 5, 7]
    q_latent, q_pe = torch.randn(7, 3, L, generator=gen), torch.randn(7, 3, R, generator=gen)
    got = mla_verify_paged(q_latent, q_pe, cache, tables, seq_lens, cu, 0.3, L)
    for n in range(2):
        q_len = cu[n + 1] - cu[n]
        for i, row in enumerate(range(cu[n], cu[n + 1])):
            length = torch.tensor([seq_lens[n] - (q_len - 1 - i)])
            want, _ = mla_decode_paged(q_latent[row : row + 1], q_pe[row : row + 1], cache, tables[n : n + 1],
                                       length, 0.3, L)
            assert torch.equal(got[row : row + 1], want), f"sequence {n} row {i}"
