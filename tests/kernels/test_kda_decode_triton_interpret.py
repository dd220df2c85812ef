"""The CUDA path's KDA decode step (triton_decode.py), run by the Triton interpreter on CPU tensors, advances the
slot pool exactly as the torch reference does: q, k, v as the strided views the layer passes (slices of one
projection), the K3 bounded gate, l2-normalized q/k, pad rows that share a pad slot, slots nobody asked for left
alone."""

from __future__ import annotations

import pytest
from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _decode_matches_reference(dtype_name: str, block_v: int, l2norm: bool, beta_sigmoid: bool) -> None:
    import torch

    from k3serve.kernels.kda import naive
    from k3serve.kernels.kda.triton_decode import kda_decode

    from _close import assert_rel_rms

    dtype = getattr(torch, dtype_name)
    N, H, K, V, num_slots, pad_slot = 5, 3, 32, 64, 9, 8
    proj = torch.randn(N, 2 * H * K + H * V, dtype=dtype)  # q | k | v of the layer, one row per sequence
    q, k, v = (t.reshape(N, H, -1) for t in proj.split([H * K, H * K, H * V], dim=-1))
    g = -5 * torch.sigmoid(torch.randn(N, H, K))  # K3 bounded gate, fp32
    beta_logits = torch.randn(N, H, dtype=dtype)  # the layer's projection, when the kernel applies the sigmoid
    beta = torch.sigmoid(beta_logits.float())
    pool = torch.randn(num_slots, H, K, V)
    slots = torch.tensor([6, 1, 3, pad_slot, pad_slot])  # two padding rows share the pad slot
    ref_pool = pool.clone()

    if beta_sigmoid:
        o = kda_decode(q, k, v, g, beta_logits, pool, slots, None, l2norm, block_v=block_v, beta_sigmoid=True)
    else:
        o = kda_decode(q, k, v, g, beta, pool, slots, None, l2norm, block_v=block_v)

    real = slots[:3]
    ref_o = naive.kda_decode(q[:3], k[:3], v[:3], g[:3], beta[:3], ref_pool, real, None, l2norm)
    assert o.dtype == dtype and o.shape == (N, H, V)
    # the interpreter rounds fp32 -> bf16 stores toward zero, the reference to nearest: one bf16 ulp apart
    out_tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert_rel_rms(f"{dtype_name} BV{block_v} output", ref_o.float(), o[:3].float(), out_tol)
    assert_rel_rms(f"{dtype_name} BV{block_v} states", ref_pool[real], pool[real], 1e-6)
    untouched = [s for s in range(num_slots) if s not in (6, 1, 3, pad_slot)]
    assert torch.equal(pool[untouched], ref_pool[untouched]), "slots outside the batch must not change"


@pytest.mark.parametrize("dtype_name, block_v, l2norm, beta_sigmoid", [
    ("bfloat16", 16, True, True), ("float16", 64, True, False), ("float32", 32, False, True)])
def test_decode_step_matches_reference_under_interpreter(dtype_name: str, block_v: int, l2norm: bool,
                                                         beta_sigmoid: bool) -> None:
    """beta_sigmoid: the kernel reads beta's logits in the projection's dtype and applies the sigmoid itself."""
    run_in_interpreter(__file__, "_decode_matches_reference", dtype_name, block_v, l2norm, beta_sigmoid)
