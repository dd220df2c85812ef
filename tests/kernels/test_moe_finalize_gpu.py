"""The unfused MXFP4 finalize on the GPU (`fused_experts(finalize="unfused")`, the fused finalize's baseline):
the same kernel pair as the fused call for the batch's tokens, the top-k sum after it, the same result; and it
records into a CUDA graph (no host sync)."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels import moe
from k3serve.kernels.moe import fused_experts, naive, triton_moe

from _close import assert_rel_rms
from test_moe_gpu import SITU, TOL, _routing, k3_bank

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T", [1, 8, 16, 256], ids=lambda t: f"T{t}")
def test_unfused_runs_the_fused_calls_kernel_pair_and_equals_it(T: int) -> None:
    weights = k3_bank()
    x = torch.randn(T, 3584, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = _routing(T, 0)
    fused = fused_experts(x, weights, topk_weights, topk_ids, SITU, 0)
    fused_path = triton_moe.last_path
    unfused = fused_experts(x, weights, topk_weights, topk_ids, SITU, 0, finalize="unfused")
    assert (moe.last_backend["fused_experts"], moe.last_backend["moe_finalize"]) == ("triton", "unfused")
    assert triton_moe.last_path == fused_path  # the pair for T tokens, not for the T * top_k rows it runs
    ref = naive.fused_experts(x, weights, topk_weights, topk_ids, SITU, 0)
    if ref.abs().max() == 0:  # no token routed to this rank
        assert unfused.abs().max() == 0
        return
    assert_rel_rms(f"unfused T{T}", ref, unfused, TOL)
    assert_rel_rms(f"unfused vs fused T{T}", fused, unfused, TOL)


def test_the_unfused_finalize_replays_in_a_cuda_graph() -> None:
    weights = k3_bank()
    x = torch.randn(4, 3584, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = _routing(4, 0)
    run = lambda: fused_experts(x, weights, topk_weights, topk_ids, SITU, 0, finalize="unfused")  # noqa: E731
    eager = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # autotuned outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.testing.assert_close(out, eager)
