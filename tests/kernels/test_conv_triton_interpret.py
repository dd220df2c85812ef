"""The CUDA path's one-token conv step (triton_conv.py), run by the Triton interpreter on CPU tensors, gives the
reference's outputs and slot states: rows of x as the strided slices the layer passes, a bf16 or fp32 pool, pad
rows that share a pad slot, slots nobody asked for left alone."""

from __future__ import annotations

import pytest
from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _decode_matches_reference(state_dtype: str, silu: bool) -> None:
    import torch

    from k3serve.kernels.conv import naive
    from k3serve.kernels.conv.triton_conv import conv_decode

    N, C, W, num_slots, pad_slot = 5, 300, 4, 9, 8  # C spans two channel blocks, the second partly
    proj = torch.randn(N, C + 17, dtype=torch.bfloat16)
    x = proj[:, :C]  # a column slice of a wider projection: row stride C + 17
    weight = torch.randn(C, W, dtype=torch.bfloat16)
    pool = torch.randn(num_slots, C, W - 1).to(getattr(torch, state_dtype))
    slots = torch.tensor([6, 1, 3, pad_slot, pad_slot])
    ref_pool = pool.clone()

    y = conv_decode(x, weight, pool, slots, silu)

    real = slots[:3]
    ref_y = naive.causal_conv1d(x[:3], weight, ref_pool, torch.arange(4), real, "silu" if silu else None)
    assert y.dtype == torch.bfloat16 and y.shape == (N, C)
    # the interpreter rounds fp32 -> bf16 stores toward zero, the reference to nearest: one bf16 ulp apart
    torch.testing.assert_close(y[:3].float(), ref_y.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(pool[real], ref_pool[real]), "the slot keeps the last W-1 inputs exactly"
    untouched = [s for s in range(num_slots) if s not in (6, 1, 3, pad_slot)]
    assert torch.equal(pool[untouched], ref_pool[untouched]), "slots outside the batch must not change"


@pytest.mark.parametrize("state_dtype, silu", [("bfloat16", True), ("float32", False)])
def test_decode_step_matches_reference_under_interpreter(state_dtype: str, silu: bool) -> None:
    run_in_interpreter(__file__, "_decode_matches_reference", state_dtype, silu)


# Prefill: the lengths are shorter than the W-1 = 3 inputs a slot keeps (1, 2), exactly W-1 (3), and long enough to
# cross one and two 64-token blocks (70, 130); the last two rows are padding that share the pad slot.
PREFILL_LENS, PREFILL_SLOTS, PAD_SLOT, NUM_SLOTS = [1, 2, 3, 70, 130, 1, 2], [6, 1, 3, 9, 0, 11, 11], 11, 12
NUM_REAL = 5  # sequences before the padding rows


def _prefill_inputs(x_dtype: str, state_dtype: str):
    """x as the column slice of a wider projection, the fp32 weight the KDA layer packs, and a pool whose every slot
    holds an old state (so the first taps of each sequence read it)."""
    import torch

    C, W = 300, 4  # C spans three 128-channel blocks, the last partly
    x = torch.randn(sum(PREFILL_LENS), C + 17).to(getattr(torch, x_dtype))[:, :C]
    weight = torch.randn(C, W)
    pool = torch.randn(NUM_SLOTS, C, W - 1).to(getattr(torch, state_dtype))
    return x, weight, pool


def _conv_prefill(x, weight, pool, lens: list[int], slots: list[int], silu: bool):
    """The kernel over the sequences of `lens`, its token blocks planned as the KDA layer plans them."""
    import torch

    from k3serve.kernels.conv.triton_prefill import conv_prefill
    from k3serve.kernels.kda import CHUNK_SIZE, plan_chunks

    return conv_prefill(x, weight, pool, torch.tensor(slots), plan_chunks(lens, True, None, CHUNK_SIZE, x.device), silu)


def _prefill_matches_reference(x_dtype: str, state_dtype: str, silu: bool) -> None:
    import torch

    from k3serve.kernels.conv import naive

    from _close import assert_close

    x, weight, pool = _prefill_inputs(x_dtype, state_dtype)
    ref_pool = pool.clone()

    y = _conv_prefill(x, weight, pool, PREFILL_LENS, PREFILL_SLOTS, silu)

    num_real_tokens = sum(PREFILL_LENS[:NUM_REAL])
    real = torch.tensor(PREFILL_SLOTS[:NUM_REAL])
    ref_y = naive.causal_conv1d(x[:num_real_tokens], weight, ref_pool, torch.tensor([0, *PREFILL_LENS[:NUM_REAL]]).cumsum(0),
                                real, "silu" if silu else None)
    assert y.dtype == x.dtype and y.shape == x.shape
    # within one rounding of the output: the interpreter rounds fp32 -> bf16 toward zero, the reference to nearest,
    # and both sum the same fp32 products (atol: the order of a sum of four, near zero)
    assert_close("y", ref_y, y[:num_real_tokens], 1e-6, 2**-7 if x_dtype == "bfloat16" else 1e-6)
    assert torch.equal(pool[real], ref_pool[real]), "the slot keeps the last W-1 inputs exactly"
    untouched = [s for s in range(NUM_SLOTS) if s not in PREFILL_SLOTS]
    assert torch.equal(pool[untouched], ref_pool[untouched]), "slots outside the batch must not change"


@pytest.mark.parametrize("x_dtype, state_dtype, silu",
                         [("bfloat16", "bfloat16", True), ("float32", "float32", False), ("bfloat16", "float32", True)])
def test_prefill_matches_reference_under_interpreter(x_dtype: str, state_dtype: str, silu: bool) -> None:
    run_in_interpreter(__file__, "_prefill_matches_reference", x_dtype, state_dtype, silu)


def _two_pieces_equal_one(cut: list[int]) -> None:
    """Every real sequence fed as its first cut[n] tokens, then the rest, gives the bits of one pass."""
    import torch

    x, weight, pool = _prefill_inputs("bfloat16", "bfloat16")
    lens, slots = PREFILL_LENS[:NUM_REAL], PREFILL_SLOTS[:NUM_REAL]
    one_pool = pool.clone()
    y_one = _conv_prefill(x[: sum(lens)], weight, one_pool, lens, slots, True)

    seqs = x[: sum(lens)].split(lens)
    ys: list[list[torch.Tensor]] = [[] for _ in lens]
    for piece in ([s[:c] for s, c in zip(seqs, cut)], [s[c:] for s, c in zip(seqs, cut)]):
        live = [n for n, p in enumerate(piece) if len(p) > 0]  # a sequence with no new tokens sits the call out
        y = _conv_prefill(torch.cat([piece[n] for n in live]), weight, pool, [len(piece[n]) for n in live],
                          [slots[n] for n in live], True)
        for n, yn in zip(live, y.split([len(piece[n]) for n in live])):
            ys[n].append(yn)
    assert torch.equal(torch.cat([torch.cat(parts) for parts in ys]), y_one)
    assert torch.equal(pool, one_pool)


@pytest.mark.parametrize("cut", [[1, 1, 2, 3, 64], [0, 1, 1, 68, 129]], ids=["early-cut", "late-cut"])
def test_prefill_in_two_pieces_equals_one_under_interpreter(cut: list[int]) -> None:
    run_in_interpreter(__file__, "_two_pieces_equal_one", cut)
