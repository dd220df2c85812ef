"""The Gluon MMA pair for MXFP4 routed experts (`kernels/moe/gluon_mma.py`) on the GPU, at K3 per-rank shapes,
against the torch reference and against the fp32-exact GEMV pair: a wrong code, sign, scale, k slot or token row
would be an O(1) error, and the only difference from the GEMV pair is h rounded to bf16. `triton_moe.last_path`
must say "mma": a silent fallback fails."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels.moe import ExpertWeights, gluon_mma, naive, silu_glu, triton_moe
from k3serve.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

from _close import assert_rel_rms
from test_moe_gpu import D, E, SITU, TOL, _routing, _skewed_routing, k3_bank, random_mxfp4

pytestmark = pytest.mark.gpu

H_BF16_TOL = 4e-3  # vs the GEMV pair: h rounded to bf16 (2^-9 relative) and nothing else


def _mma(x, weights, topk_weights, topk_ids, activation=SITU) -> torch.Tensor:
    out = triton_moe.fused_experts(x, weights, topk_weights, topk_ids, activation, 0, path="mma")
    assert triton_moe.last_path == "mma"
    return out


@pytest.mark.parametrize("T, skewed", [(1, False), (4, False), (16, False), (64, False), (64, True), (192, False)],
                         ids=["T1", "T4", "T16", "T64", "T64-skewed", "T192"])
def test_k3_rank_shapes_match_the_reference_and_the_exact_gemv(T: int, skewed: bool) -> None:
    """Skewed: rank 0's experts 0..6 take ~36 rows each (5 token tiles of 8 a program)."""
    weights = k3_bank()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = _skewed_routing(T) if skewed else _routing(T, 0)
    topk_ids[0, 0] = 5  # at least one pair on this rank
    out = _mma(x, weights, topk_weights, topk_ids)
    assert_rel_rms("out vs reference", naive.fused_experts(x, weights, topk_weights, topk_ids, SITU, 0), out, TOL)
    exact = triton_moe.fused_experts(x, weights, topk_weights, topk_ids, SITU, 0, path="gemv")
    assert_rel_rms("out vs fp32-exact GEMV", exact, out, H_BF16_TOL)


def test_swiglu_and_experts_on_other_ranks() -> None:
    weights = ExpertWeights(*(quantize_mxfp4(torch.randn(4, *s, device="cuda") * 0.05)
                              for s in ((256, 512), (256, 512), (512, 256))))
    x = torch.randn(20, 512, device="cuda", dtype=torch.bfloat16)
    topk_ids = torch.tensor([[1, 2, 9]] * 20, device="cuda")  # 20 rows on experts 1 and 2; 9 lives on another rank
    topk_weights = torch.rand(20, 3, device="cuda")
    out = _mma(x, weights, topk_weights, topk_ids, silu_glu)
    assert_rel_rms("out", naive.fused_experts(x, weights, topk_weights, topk_ids, silu_glu, 0), out, TOL)


def test_nan_scale_poisons_only_its_row() -> None:
    weights = ExpertWeights(*(random_mxfp4(2, *s) for s in ((64, 128), (64, 128), (128, 64))))
    weights.w2.scales[1, 3, 1] = 0xFF  # expert 1, output column 3, its second group
    x = torch.randn(2, 128, device="cuda", dtype=torch.bfloat16)
    ids, w = torch.tensor([[0], [1]], device="cuda"), torch.ones(2, 1, device="cuda")
    out = _mma(x, weights, w, ids, silu_glu)
    assert torch.isfinite(out[0]).all() and out[1, 3].isnan()
    assert torch.isfinite(out[1, :3]).all() and torch.isfinite(out[1, 4:]).all()


def test_replays_in_a_cuda_graph_on_new_routing() -> None:
    weights = k3_bank()
    x = torch.randn(32, D, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = _routing(32, 0)
    _mma(x, weights, topk_weights, topk_ids)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _mma(x, weights, topk_weights, topk_ids)
    new_weights, new_ids = _routing(32, 0)
    x.copy_(torch.randn_like(x))
    topk_weights.copy_(new_weights)
    topk_ids.copy_(new_ids)
    graph.replay()
    assert_rel_rms("replayed out", naive.fused_experts(x, weights, topk_weights, topk_ids, SITU, 0), out, TOL)


@pytest.mark.parametrize("s", [0, 1, 64, 127, 191, 192, 254])
def test_every_code_is_exact_at_every_scale_exponent(s: int) -> None:
    """The down kernel on all 16 codes (the subnormal 0.5 among them: the upcast's bf16 subnormal times 2^126) at one
    E8M0 scale s, activations scaled by 2^(127 - s) (within 2^+-100, so the MMA's fp32 sums stay finite), against
    the fp64 sum of the exact products. A flushed subnormal, a wrong sign or a scale factor that overflows is an
    O(1) error."""
    w2 = random_mxfp4(1, 128, 64)
    w2.packed.copy_(torch.arange(256, dtype=torch.uint8, device="cuda").repeat(16).view(1, 128, 32))
    w2.scales.fill_(s)
    h = (torch.randn(1, 64, device="cuda") * 2.0 ** max(-100, min(100, 127 - s))).to(torch.bfloat16)
    codes = dequantize_mxfp4(w2.packed[0], torch.full_like(w2.scales[0], 127), torch.float64)  # [128, 64] exact
    expected = (h.double() @ codes.T) * 2.0 ** (s - 127)  # [1, 128]
    out = torch.zeros(1, 128, device="cuda")
    routing = triton_moe.route(torch.zeros(1, 1, dtype=torch.int64, device="cuda"), 0, 1)
    gluon_mma.down_projection(h, w2, out, torch.ones(1, device="cuda"), routing, 1)
    assert ((out.double() - expected).abs() / expected.abs().max()).max() < 1e-6
