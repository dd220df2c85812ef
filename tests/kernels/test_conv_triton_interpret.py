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
