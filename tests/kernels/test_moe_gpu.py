"""MXFP4 routed experts on the GPU (Triton w4a16, SiTU-GLU and finalize fused) against the torch
reference, at K3 per-rank shapes: latent 3584, intermediate 3072, 112 local experts, top-16 of 896.
Decode batches up to GEMV_MAX_TOKENS must run the GEMV kernels (triton_gemv.py), then up to MMA_MAX_TOKENS the
Gluon MMA ones (gluon_mma.py), larger ones the tensor-core ones (on sm_100 / sm_103 every batch the block-scaled
ones, triton_scaled.py); `triton_moe.last_path` says which ran, so a silent switch fails."""

from __future__ import annotations

import functools

import pytest
import torch

from k3serve.kernels import moe
from k3serve.kernels.moe import ExpertWeights, fused_experts, naive, silu_glu, situ_glu, triton_moe
from k3serve.kernels.mxfp4 import MXFP4Tensor, quantize_mxfp4

from _close import assert_rel_rms

pytestmark = pytest.mark.gpu

D, I, E, E_TOTAL, TOP_K = 3584, 3072, 112, 896, 16
SITU = functools.partial(situ_glu, beta=4.0, linear_beta=25.0)
TOL = 1e-2  # bf16 activations and a bf16 intermediate h (sm_100: their two MXFP8 terms)


def random_mxfp4(*shape: int, device: str = "cuda") -> MXFP4Tensor:
    """Random codes (all 16, signs included) with E8M0 scales around 2^-6: a valid MXFP4 bank of
    weights with magnitude ~0.05, without quantizing a dense tensor first."""
    *lead, out, inp = shape
    packed = torch.randint(0, 256, (*lead, out, inp // 2), dtype=torch.uint8, device=device)
    scales = torch.randint(119, 123, (*lead, out, inp // 32), dtype=torch.uint8, device=device)
    return MXFP4Tensor(packed, scales)


@functools.cache
def k3_bank() -> ExpertWeights:
    return ExpertWeights(random_mxfp4(E, I, D), random_mxfp4(E, I, D), random_mxfp4(E, D, I))


def _routing(T: int, expert_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E_TOTAL, device="cuda")[:TOP_K] for _ in range(T)])
    weights = torch.rand(T, TOP_K, device="cuda")
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("expert_start", [0, 3 * E], ids=["rank0", "rank3"])
@pytest.mark.parametrize("T", [1, 4, 16, 64, 256], ids=lambda t: f"T{t}")
def test_k3_rank_shapes(T: int, expert_start: int) -> None:
    """The benchmarked decode batches on the GEMV or MMA kernels, a prefill chunk on the tensor-core kernels."""
    weights = k3_bank()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = _routing(T, expert_start)
    out = fused_experts(x, weights, topk_weights, topk_ids, SITU, expert_start)
    assert moe.last_backend["fused_experts"] == "triton"
    assert triton_moe.last_path == triton_moe.kernel_pair(T, x.device)  # thresholds: test_moe_scaled_dispatch.py
    ref = naive.fused_experts(x, weights, topk_weights, topk_ids, SITU, expert_start)
    assert out.dtype == torch.float32 and out.shape == (T, D)
    if ref.abs().max() == 0:  # no token routed to this rank
        assert (out == 0).all()
    else:
        assert_rel_rms("out", ref, out, TOL)


@pytest.mark.parametrize("path", ["gemv", "dot"])
def test_skewed_routing_many_rows_per_expert_silu(path: str) -> None:
    """64 tokens on the same 2 local experts: 64 rows each, many row chunks (GEMV) or M tiles (dot) per
    program; SwiGLU."""
    weights = ExpertWeights(*(quantize_mxfp4(torch.randn(4, *s, device="cuda") * 0.05)
                              for s in ((256, 512), (256, 512), (512, 256))))
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    topk_ids = torch.tensor([[1, 2, 9]] * 64, device="cuda")  # 9 lives on another rank
    topk_weights = torch.rand(64, 3, device="cuda")
    out = triton_moe.fused_experts(x, weights, topk_weights, topk_ids, silu_glu, 0, path=path)
    assert triton_moe.last_path == path
    assert_rel_rms("out", naive.fused_experts(x, weights, topk_weights, topk_ids, silu_glu, 0), out, TOL)


def test_gemv_path_replays_in_a_cuda_graph() -> None:
    """Decode runs under CUDA graphs: routing and both GEMV kernels (sm_100: the block-scaled pair) capture (no host
    sync) and a replay on new inputs matches the reference."""
    weights = k3_bank()
    x = torch.randn(4, D, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = _routing(4, 0)
    fused_experts(x, weights, topk_weights, topk_ids, SITU, 0)  # autotune outside the capture
    assert triton_moe.last_path == triton_moe.kernel_pair(4, x.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, weights, topk_weights, topk_ids, SITU, 0)
    new_weights, new_ids = _routing(4, 0)
    while not (new_ids < E).any():  # rank 0 must get a pair (misses about 1 time in 5000)
        new_weights, new_ids = _routing(4, 0)
    x.copy_(torch.randn_like(x))
    topk_weights.copy_(new_weights)
    topk_ids.copy_(new_ids)
    graph.replay()
    ref = naive.fused_experts(x, weights, topk_weights, topk_ids, SITU, 0)
    assert ref.abs().max() > 0
    assert_rel_rms("replayed out", ref, out, TOL)


def test_unknown_activation_falls_back() -> None:
    weights = ExpertWeights(*(random_mxfp4(2, *s) for s in ((64, 128), (64, 128), (128, 64))))
    x = torch.randn(3, 128, device="cuda", dtype=torch.bfloat16)
    ids, w = torch.zeros(3, 1, dtype=torch.int64, device="cuda"), torch.ones(3, 1, device="cuda")
    fused_experts(x, weights, w, ids, lambda g, u: g * u, 0)
    assert moe.last_backend["fused_experts"] == "naive"


def _skewed_routing(T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's experts 0..6 take 4 of each token's TOP_K pairs (~36 rows each at T 64: long row loops on every
    tile), the rest go to other ranks."""
    ids = torch.stack([torch.cat([torch.randperm(7, device="cuda")[:4], E + torch.randperm(E_TOTAL - E, device="cuda")
                                  [:TOP_K - 4]]) for _ in range(T)])
    weights = torch.rand(T, TOP_K, device="cuda")
    return weights / weights.sum(-1, keepdim=True), ids


def _assert_gemv_fp32_exact(T: int, case: str, skewed: bool = False) -> None:
    weights = k3_bank()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = _skewed_routing(T) if skewed else _routing(T, 0)
    topk_ids[0, 0] = 5  # at least one pair on this rank
    out = triton_moe.fused_experts(x, weights, topk_weights, topk_ids, SITU, 0, path="gemv")
    assert_rel_rms(case, naive.fused_experts(x, weights, topk_weights, topk_ids, SITU, 0), out, 1e-5)


@pytest.mark.parametrize("T", [1, 16], ids=lambda t: f"T{t}")
def test_gemv_path_is_fp32_exact_at_k3_shapes(T: int) -> None:
    """The GEMV pair computes in fp32 on exactly decoded weights (inline PTX decode, scale and 16-byte x loads on
    the GPU), so with bf16 activations it matches the fp32 reference to fp32 rounding: a wrong code, sign, scale or
    x position could not hide in the bf16 tolerance of the other tests."""
    _assert_gemv_fp32_exact(T, "out")


@pytest.mark.parametrize("kernel_name", ["gemv_up_kernel", "gemv_down_kernel"])
def test_every_gemv_config_is_fp32_exact(kernel_name: str) -> None:
    """Each tile config the autotuner may pick, run alone (the other kernel autotuned), is fp32-exact at T 1 and
    16 and at T 64 with skewed routing (experts of many rows): a config that loses the timing on this GPU but
    wins on another cannot hide a wrong result."""
    from k3serve.kernels.moe import triton_gemv

    kernel = getattr(triton_gemv, kernel_name)
    saved = kernel.configs
    try:
        for config in saved:
            kernel.configs = [config]  # one config: launched without benchmarking
            kernel.cache.clear()
            for T, skewed in ((1, False), (16, False), (64, True)):
                _assert_gemv_fp32_exact(T, f"{kernel_name} {config} T{T}", skewed)
    finally:
        kernel.configs = saved
        kernel.cache.clear()


def test_gemv_nan_scale_and_misaligned_x() -> None:
    """E8M0 0xFF is NaN on the PTX path too (K = 64: a block with groups past K), and an x that starts off a
    16-byte boundary (a view one element in) runs the plain Triton loads and matches the reference."""
    weights = ExpertWeights(*(random_mxfp4(2, *s) for s in ((64, 128), (64, 128), (128, 64))))
    weights.w2.scales[1, 3, 0] = 0xFF
    x = torch.randn(2, 128, device="cuda", dtype=torch.bfloat16)
    ids, w = torch.tensor([[0], [1]], device="cuda"), torch.ones(2, 1, device="cuda")
    out = triton_moe.fused_experts(x, weights, w, ids, silu_glu, 0, path="gemv")
    assert torch.isfinite(out[0]).all() and out[1, 3].isnan() and torch.isfinite(out[1, :3]).all()
    shifted = torch.randn(2 * 128 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(2, 128)
    assert shifted.data_ptr() % 16 != 0
    ids = torch.tensor([[0], [0]], device="cuda")
    out = triton_moe.fused_experts(shifted, weights, w, ids, silu_glu, 0, path="gemv")
    assert_rel_rms("misaligned x", naive.fused_experts(shifted, weights, w, ids, silu_glu, 0), out, 1e-5)
