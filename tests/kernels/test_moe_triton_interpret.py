"""The CUDA path's MXFP4 routed experts (triton_moe.py: two grouped GEMMs that unpack the 4-bit weights in
registers, SiTU/SwiGLU fused into the first, the top-k weighting and sum fused into the second), run by the
Triton interpreter on CPU tensors, match the torch reference (naive.py). test_moe_gpu.py checks bf16 at K3
shapes on the device; the interpreter cannot multiply bf16 (see _triton_interpret), so here the
activations are fp32 (the same weights unpacked to fp32: near-exact) and fp16."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def rank_1_of_3_case(E: int, I: int, D: int, T: int):
    """Rank 1 of 3 (experts E..2E-1 of 3E), top 3: random MXFP4 banks (CPU), ids, weights and fp32 x [T, D]. Expert
    E + 1 takes every token, E + 3 none, and the last token is wholly other ranks'."""
    import torch

    from k3serve.kernels.moe import ExpertWeights

    from test_moe_gpu import random_mxfp4

    weights = ExpertWeights(random_mxfp4(E, I, D, device="cpu"), random_mxfp4(E, I, D, device="cpu"),
                            random_mxfp4(E, D, I, device="cpu"))
    others = torch.tensor([e for e in range(3 * E) if e not in (E + 1, E + 3)])  # E + 3 gets no token
    topk_ids = torch.stack([others[torch.randperm(len(others))[:3]] for _ in range(T)])
    topk_ids[:, 0] = E + 1
    topk_ids[T - 1] = torch.tensor([0, 9, 11])
    return weights, topk_ids, torch.rand(T, 3), torch.randn(T, D)


def _experts_match_reference() -> None:
    """Rank 1 of 3 (experts 4..7 of 12): one local expert takes every token (20 rows, two M tiles of 16),
    another none, one token is wholly another rank's; every tile the autotuner may pick at these sizes."""
    import torch

    from k3serve.kernels.moe import naive, silu_glu, triton_moe

    from _close import assert_rel_rms
    from test_moe_gpu import SITU

    E, I, D, T = 4, 128, 256, 20
    weights, topk_ids, topk_weights, x = rank_1_of_3_case(E, I, D, T)
    for config in triton_moe._prune(triton_moe._configs(), {"I": I, "D": D}):
        triton_moe._up_kernel.configs = triton_moe._down_kernel.configs = [config]  # no driver to benchmark
        for activation, dtype, tol in ((SITU, torch.float32, 1e-5), (silu_glu, torch.float16, 2e-3)):
            case = f"{config}, {dtype}, {getattr(activation, 'func', activation).__name__}"
            out = triton_moe.fused_experts(x.to(dtype), weights, topk_weights, topk_ids, activation, E, path="dot")
            ref = naive.fused_experts(x.to(dtype), weights, topk_weights, topk_ids, activation, E)
            assert out.dtype == torch.float32 and ref[T - 1].abs().max() == 0, case
            assert_rel_rms(f"out, {case}", ref, out, tol)
            assert (out[T - 1] == 0).all(), case


def test_experts_match_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_experts_match_reference")
