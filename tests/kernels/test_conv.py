"""Causal short conv with a slot pool: a sequence fed in pieces equals one pass, and the pool is
read and written only at the given slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3serve.kernels.conv import causal_conv1d
from k3serve.kernels.kda import plan_chunks

from _close import assert_close

C, W = 48, 4
LENS = [1, 2, 5, 37, 130]  # shorter than, equal to and longer than the W-1 = 3 token state


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0)


def _fresh_reference(x: torch.Tensor, weight: torch.Tensor, lens: list[int], activation: str | None) -> torch.Tensor:
    """Each sequence from a zero state: conv1d over the sequence left-padded with W-1 zeros."""
    ys = []
    for xs in x.double().split(lens):
        y = F.conv1d(F.pad(xs.T[None], (W - 1, 0)), weight.double()[:, None], groups=C)[0].T
        ys.append(F.silu(y) if activation == "silu" else y)
    return torch.cat(ys)


def _pool(num_slots: int, slots: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A pool poisoned with 1e30 everywhere but the (zeroed) slots in use."""
    pool = torch.full((num_slots, C, W - 1), 1e30, dtype=dtype)
    pool[slots] = 0
    return pool


@pytest.mark.parametrize("activation", ["silu", None], ids=lambda a: f"act-{a}")
def test_fresh_sequences_match_zero_padded_conv_and_poison_stays_put(activation: str | None) -> None:
    x, weight = torch.randn(sum(LENS), C), torch.randn(C, W)
    slots = torch.tensor([7, 0, 12, 3, 9])
    pool = _pool(15, slots)
    y = causal_conv1d(x, weight, pool, _cu(LENS), slots, activation)
    assert_close("y", _fresh_reference(x, weight, LENS, activation), y.double(), 1e-5, 1e-5)
    unused = torch.ones(15, dtype=torch.bool)
    unused[slots] = False
    assert (pool[unused] == 1e30).all()
    for n, xs in enumerate(x.split(LENS)):  # the state is the last W-1 inputs, zero-filled when short
        last = F.pad(xs.T, (W - 1, 0))[:, -(W - 1) :]
        assert torch.equal(pool[slots[n]], last)


def _conv_pieces(pieces: list[torch.Tensor], weight: torch.Tensor, pool: torch.Tensor,
                 slots: torch.Tensor) -> list[torch.Tensor]:
    """One call over the non-empty pieces (a sequence with no new tokens sits the call out)."""
    live = [n for n, p in enumerate(pieces) if len(p) > 0]
    y = causal_conv1d(torch.cat([pieces[n] for n in live]), weight, pool,
                      _cu([len(pieces[n]) for n in live]), slots[live])
    ys = [p[:0] for p in pieces]
    for n, yn in zip(live, y.split([len(pieces[n]) for n in live])):
        ys[n] = yn
    return ys


@pytest.mark.parametrize("cut", [[1, 1, 2, 3, 64], [0, 1, 4, 36, 129]], ids=["early-cut", "late-cut"])
def test_two_calls_equal_one_call(cut: list[int]) -> None:
    """The first call covers cut[n] tokens of sequence n, the second the rest."""
    x, weight = torch.randn(sum(LENS), C), torch.randn(C, W)
    slots = torch.tensor([4, 1, 8, 2, 6])
    one_pool = _pool(10, slots)
    y_one = causal_conv1d(x, weight, one_pool, _cu(LENS), slots)

    pool = _pool(10, slots)
    seqs = x.split(LENS)
    y_first = _conv_pieces([xs[:c] for xs, c in zip(seqs, cut)], weight, pool, slots)
    y_second = _conv_pieces([xs[c:] for xs, c in zip(seqs, cut)], weight, pool, slots)
    y_two = torch.cat([torch.cat(pair) for pair in zip(y_first, y_second)])
    assert_close("y", y_one, y_two, 1e-6, 1e-6)
    assert torch.equal(pool, one_pool)


def test_token_by_token_decode_equals_one_call() -> None:
    """Decode feeds one token per call, fewer than W-1, so the state window must shift."""
    x, weight = torch.randn(9, C), torch.randn(C, W)
    slot = torch.tensor([2])
    one_pool = _pool(4, slot)
    y_one = causal_conv1d(x, weight, one_pool, _cu([9]), slot)
    pool = _pool(4, slot)
    y_steps = torch.cat([causal_conv1d(x[t : t + 1], weight, pool, _cu([1]), slot) for t in range(9)])
    assert_close("y", y_one, y_steps, 1e-6, 1e-6)
    assert torch.equal(pool, one_pool)


def test_bf16_input_and_state_give_bf16_output() -> None:
    x, weight = torch.randn(20, C, dtype=torch.bfloat16), torch.randn(C, W)
    slots = torch.tensor([1])
    pool = _pool(2, slots, torch.bfloat16)
    y = causal_conv1d(x, weight, pool, _cu([20]), slots)
    assert y.dtype == torch.bfloat16
    assert_close("y", _fresh_reference(x, weight, [20], "silu").bfloat16(), y, 2e-2, 2e-2)
    assert torch.equal(pool[1], x[-(W - 1) :].T)


def test_bad_arguments_raise_clear_errors() -> None:
    x, weight, pool = torch.randn(10, C), torch.randn(C, W), torch.zeros(4, C, W - 1)
    cu, slots = _cu([4, 6]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, pool, cu, slots, "gelu")
    with pytest.raises(ValueError, match="conv_state must be"):
        causal_conv1d(x, weight, torch.zeros(4, C, W), cu, slots)
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly from 0 to T=10"):
        causal_conv1d(x, weight, pool, _cu([4, 5]), slots)
    with pytest.raises(ValueError, match="cu_seqlens must be int64"):
        causal_conv1d(x, weight, pool, cu.int(), slots)
    with pytest.raises(ValueError, match="distinct slots"):
        causal_conv1d(x, weight, pool, cu, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="distinct slots"):
        causal_conv1d(x, weight, pool, cu, torch.tensor([0, 4]))


def test_a_chunk_plan_must_describe_the_call() -> None:
    """The KDA layer passes its batch's chunk plan (the GPU kernel's token blocks): one for these sequences changes
    nothing on the CPU, one for others is refused."""
    x, weight = torch.randn(10, C), torch.randn(C, W)
    cu, slots = _cu([4, 6]), torch.tensor([0, 1])
    pool, planned_pool = _pool(2, slots), _pool(2, slots)
    y = causal_conv1d(x, weight, pool, cu, slots)
    planned_y = causal_conv1d(x, weight, planned_pool, cu, slots, plan=plan_chunks([4, 6], True, None, 64, "cpu"))
    assert torch.equal(planned_y, y) and torch.equal(planned_pool, pool)
    for lens, varlen in (([5, 5], True), ([4, 6, 1], True), ([10], False)):
        with pytest.raises(ValueError, match="does not describe this call's N=2 sequences of T=10"):
            causal_conv1d(x, weight, pool, cu, slots, plan=plan_chunks(lens, varlen, None, 64, "cpu"))
