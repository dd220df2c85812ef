"""The decode path's MXFP4 routed experts (triton_gemv.py: GEMV on the CUDA cores, a few rows per expert)
run by the Triton interpreter on CPU tensors and match the torch reference (naive.py). The kernels use no
tl.dot, so bf16 activations (the real dtype) are checked here too; fp32 activations check the decode
exactly, including E8M0 scales at both ends of the range."""

from __future__ import annotations

import pytest

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


TILINGS = ("split-K 2", "one K block past the row", "whole blocks, prefetch 2")


def _experts_match_reference(tiling: str) -> None:
    """Rank 1 of 3 (experts 4..7 of 12): expert 5 takes every token (9 rows), expert 7 none, the last token
    lives wholly on other ranks. I = 96 and D = 160 leave tails in N (BLOCK_N 64) and in K (BLOCK_K 128 and 512
    are not divisors); scales 0, 1 and 240 (2^-127 .. 2^113) sit in the fp32 cases' bank. Three tilings, each
    on 3 persistent programs that walk several tiles: split-K 2 (the second share has no block), one K block
    longer than the whole row, and whole blocks (BLOCK_K 32: 5 up and 3 down, split 2 and 1) prefetched 2
    ahead."""
    import torch
    import triton

    from k3serve.kernels.moe import ExpertWeights, naive, silu_glu, triton_gemv, triton_moe

    from _close import assert_rel_rms
    from test_moe_gpu import SITU, random_mxfp4

    E, I, D, T, TOP_K = 4, 96, 160, 9, 3
    weights = ExpertWeights(random_mxfp4(E, I, D, device="cpu"), random_mxfp4(E, I, D, device="cpu"),
                            random_mxfp4(E, D, I, device="cpu"))
    others = torch.tensor([e for e in range(3 * E) if e not in (E + 1, E + 3)])
    topk_ids = torch.stack([others[torch.randperm(len(others))[:TOP_K]] for _ in range(T)])
    topk_ids[:, 0] = E + 1
    topk_ids[T - 1] = torch.tensor([0, 9, 11])
    topk_weights = torch.rand(T, TOP_K)
    x = torch.randn(T, D)
    extreme = ExpertWeights(*(type(w)(w.packed, w.scales.clone()) for w in (weights.w1, weights.w3, weights.w2)))
    extreme.w3.scales[1, :, 0] = 0  # expert 5 (local 1), group 0 of every row: 2^-127
    extreme.w3.scales[1, :8, 1] = 1
    extreme.w1.scales[1, 8:16, 2] = 240  # gate values ~2^113: SiTU saturates, still finite
    cases = dict(zip(TILINGS, (
        ({"BLOCK_N": 64, "BLOCK_K": 128, "PREFETCH": 2}, 2, extreme, SITU, torch.float32, 1e-5),
        ({"BLOCK_N": 16, "BLOCK_K": 512, "PREFETCH": 1}, 1, weights, silu_glu, torch.bfloat16, 1e-2),
        ({"BLOCK_N": 32, "BLOCK_K": 32, "PREFETCH": 2}, 2, extreme, SITU, torch.float32, 1e-5))))
    tiles, split_k, bank, activation, dtype, tol = cases[tiling]
    tiles = {**tiles, "PROGRAMS_PER_SM": 1}  # the interpreter's grid: 3 programs (triton_gemv.programs)
    triton_gemv.gemv_up_kernel.configs = [triton.Config(tiles)]  # no driver to benchmark
    triton_gemv.gemv_down_kernel.configs = [triton.Config({**tiles, "SPLIT_K": split_k})]
    out = triton_moe.fused_experts(x.to(dtype), bank, topk_weights, topk_ids, activation, E, path="gemv")
    assert triton_moe.last_path == "gemv"
    ref = naive.fused_experts(x.to(dtype), bank, topk_weights, topk_ids, activation, E)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert_rel_rms(f"out, {tiling}", ref, out, tol)
    assert (out[T - 1] == 0).all()


@pytest.mark.parametrize("tiling", TILINGS)
def test_gemv_experts_match_reference_under_interpreter(tiling: str) -> None:
    run_in_interpreter(__file__, "_experts_match_reference", tiling)


def _nan_scale_is_loud() -> None:
    """E8M0 0xFF is NaN: the rows of an expert holding it come out NaN, never a finite guess."""
    import torch
    import triton

    from k3serve.kernels.moe import ExpertWeights, silu_glu, triton_gemv, triton_moe

    from test_moe_gpu import random_mxfp4

    weights = ExpertWeights(random_mxfp4(2, 64, 64, device="cpu"), random_mxfp4(2, 64, 64, device="cpu"),
                            random_mxfp4(2, 64, 64, device="cpu"))
    weights.w2.scales[1, 3, 0] = 0xFF
    tiles = {"BLOCK_N": 16, "BLOCK_K": 64, "PREFETCH": 1, "PROGRAMS_PER_SM": 1}
    triton_gemv.gemv_up_kernel.configs = [triton.Config(tiles)]
    triton_gemv.gemv_down_kernel.configs = [triton.Config({**tiles, "SPLIT_K": 1})]
    out = triton_moe.fused_experts(torch.randn(2, 64), weights, torch.ones(2, 1), torch.tensor([[0], [1]]),
                                   silu_glu, 0, path="gemv")
    assert torch.isfinite(out[0]).all() and out[1, 3].isnan() and torch.isfinite(out[1, :3]).all()


def test_nan_scale_is_loud_under_interpreter() -> None:
    run_in_interpreter(__file__, "_nan_scale_is_loud")


def _routing_kernel_matches_torch_routing() -> None:
    """The decode path's one-program routing gives route()'s exact outputs: pairs grouped by local expert
    in token order, starts, counts, the active list (experts with pairs first) and their number; also
    for a rank that gets no pair and for a local expert count that is not a power of two."""
    import torch

    from k3serve.kernels.moe import triton_moe

    cases = [(1, 16, 112, 0, 896), (13, 3, 4, 4, 12), (64, 16, 112, 336, 896), (3, 2, 5, 10, 15), (1, 4, 6, 0, 6)]
    for T, top_k, num_local, start, total in cases:
        ids = torch.stack([torch.randperm(total)[:top_k] for _ in range(T)])
        if (T, start) == (3, 10):
            ids = ids % 10  # rank 2 of 3 gets nothing
        want = triton_moe.route(ids, start, num_local)
        got = triton_moe.route_small(ids, start, num_local)
        case = f"T {T}, top-{top_k}, experts [{start}, {start + num_local}) of {total}"
        assert torch.equal(got[0], want[0]) and torch.equal(got[4], want[4]), case
        for name, g, w in zip(("starts", "counts", "active"), got[1:4], want[1:4]):
            assert torch.equal(g, w), f"{name}, {case}"


def test_routing_kernel_matches_torch_routing_under_interpreter() -> None:
    run_in_interpreter(__file__, "_routing_kernel_matches_torch_routing")


def _no_pairs_and_too_many_pairs() -> None:
    """Tokens that route to no expert (top-0) add nothing on either kernel pair, as in the reference; the
    one-program routing refuses what one program cannot hold rather than launching it."""
    import pytest
    import torch

    from k3serve.kernels.moe import ExpertWeights, naive, silu_glu, triton_moe

    from test_moe_gpu import random_mxfp4

    weights = ExpertWeights(random_mxfp4(2, 64, 64, device="cpu"), random_mxfp4(2, 64, 64, device="cpu"),
                            random_mxfp4(2, 64, 64, device="cpu"))
    x, no_pairs = torch.randn(3, 64), torch.zeros(3, 0, dtype=torch.int64)
    ref = naive.fused_experts(x, weights, torch.ones(3, 0), no_pairs, silu_glu, 0)
    for path in ("gemv", "dot"):
        out = triton_moe.fused_experts(x, weights, torch.ones(3, 0), no_pairs, silu_glu, 0, path=path)
        assert torch.equal(out, ref) and not out.any(), path
    for ids in (no_pairs, torch.zeros(65, 16, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"route_small takes 1\.\.1024"):
            triton_moe.route_small(ids, 0, 2)


def test_no_pairs_and_too_many_pairs_under_interpreter() -> None:
    run_in_interpreter(__file__, "_no_pairs_and_too_many_pairs")
