"""The Blackwell MXFP4 experts (`kernels/moe/triton_scaled.py`) on an sm_100 / sm_103 GPU, at K3 per-rank shapes
(latent 3584, intermediate 3072, 112 local experts, top-16 of 896): every batch size dispatches to them
(`triton_moe.last_path == "scaled"`, so a silent fallback fails), they match the exact model of their math (the torch
reference on the two MXFP8 terms of x and of h) to 1e-3 relative RMS and the bf16 reference to TOL (1e-2, as the
Hopper pairs), and they replay in a CUDA graph. Written without a Blackwell GPU: none of this has run yet
(docs/design/moe_blackwell_fp4.md)."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels import moe
from k3serve.kernels.moe import fused_experts, naive, silu_glu, triton_moe

from _close import assert_rel_rms
from test_moe_gpu import D, SITU, TOL, _routing, k3_bank, random_mxfp4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != triton_moe.SCALED_MAJOR,
    reason="needs an sm_100 / sm_103 GPU (B200, GB300)")]

MODEL_TOL = 1e-3  # vs the exact model: fp32 order and the GLU may move a bf16 rounding of h (3e-5 interpreted, fp16)


def _model(x, weights, topk_weights, topk_ids, activation, expert_start: int) -> torch.Tensor:
    def act(gate, up):  # h is stored bf16, then split by the down kernel
        return naive.round_to_mxfp8_pair(activation(gate, up).to(torch.bfloat16))
    return naive.fused_experts(naive.round_to_mxfp8_pair(x), weights, topk_weights, topk_ids, act, expert_start)


@pytest.mark.parametrize("expert_start", [0, 3 * 112], ids=["rank0", "rank3"])
@pytest.mark.parametrize("T", [1, 4, 16, 64, 256, 1024], ids=lambda t: f"T{t}")
def test_k3_rank_shapes_run_the_block_scaled_pair(T: int, expert_start: int) -> None:
    weights = k3_bank()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = _routing(T, expert_start)
    topk_ids[0, 0] = expert_start + 5  # at least one pair on this rank
    out = fused_experts(x, weights, topk_weights, topk_ids, SITU, expert_start)
    assert (moe.last_backend["fused_experts"], triton_moe.last_path) == ("triton", "scaled")
    assert_rel_rms("out vs model", _model(x, weights, topk_weights, topk_ids, SITU, expert_start), out, MODEL_TOL)
    ref = naive.fused_experts(x, weights, topk_weights, topk_ids, SITU, expert_start)
    assert_rel_rms("out vs bf16 reference", ref, out, TOL)


def test_every_config_matches_the_model_with_many_rows_per_expert() -> None:
    """Each token tile the autotuner may pick for each kernel, alone, on 64 tokens that all hit 2 experts (64 rows: 4
    tiles of 16), SwiGLU; I = 256 and D = 512 are 2 and 4 weight tiles."""
    from k3serve.kernels.moe import ExpertWeights, triton_scaled

    weights = ExpertWeights(random_mxfp4(4, 256, 512), random_mxfp4(4, 256, 512), random_mxfp4(4, 512, 256))
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    topk_ids = torch.tensor([[1, 2, 9]] * 64, device="cuda")  # 9 lives on another rank
    topk_weights = torch.rand(64, 3, device="cuda")
    model = _model(x, weights, topk_weights, topk_ids, silu_glu, 0)
    kernels = (triton_scaled.scaled_up_kernel, triton_scaled.scaled_down_kernel)
    saved = [k.configs for k in kernels]
    try:
        for i, down_config in enumerate(saved[1]):
            for k, config in zip(kernels, (saved[0][i % len(saved[0])], down_config)):
                k.configs = [config]
                k.cache.clear()
            out = triton_moe.fused_experts(x, weights, topk_weights, topk_ids, silu_glu, 0, path="scaled")
            assert triton_moe.last_path == "scaled"
            assert_rel_rms(f"out, down {down_config}", model, out, MODEL_TOL)
    finally:
        for k, configs in zip(kernels, saved):
            k.configs = configs
            k.cache.clear()


def test_the_block_scaled_pair_replays_in_a_cuda_graph() -> None:
    weights = k3_bank()
    x = torch.randn(4, D, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = _routing(4, 0)
    fused_experts(x, weights, topk_weights, topk_ids, SITU, 0)  # autotune outside the capture
    assert triton_moe.last_path == "scaled"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, weights, topk_weights, topk_ids, SITU, 0)
    new_weights, new_ids = _routing(4, 0)
    new_ids[0, 0] = 3
    x.copy_(torch.randn_like(x))
    topk_weights.copy_(new_weights)
    topk_ids.copy_(new_ids)
    graph.replay()
    assert_rel_rms("replayed out", _model(x, weights, topk_weights, topk_ids, SITU, 0), out, MODEL_TOL)


def test_a_shape_it_does_not_tile_runs_the_upcast_pair() -> None:
    from k3serve.kernels.moe import ExpertWeights

    weights = ExpertWeights(random_mxfp4(2, 192, 256), random_mxfp4(2, 192, 256), random_mxfp4(2, 256, 192))
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    ids, w = torch.zeros(3, 1, dtype=torch.int64, device="cuda"), torch.ones(3, 1, device="cuda")
    out = fused_experts(x, weights, w, ids, silu_glu, 0)
    assert triton_moe.last_path == triton_moe.upcast_pair(3)
    assert_rel_rms("out", naive.fused_experts(x, weights, w, ids, silu_glu, 0), out, TOL)
