"""The one-token conv step on the GPU is one Triton launch that matches the reference at K3's per-rank shape
(q|k|v of 12 heads x 128 = 4608 channels, kernel 4), through `causal_conv1d` as the KDA layer calls it, and
replays inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels import conv
from k3serve.kernels.conv import causal_conv1d, naive

pytestmark = pytest.mark.gpu

C, W, SLOTS = 4608, 4, 80


def _inputs(N: int, state_dtype: torch.dtype):
    proj = torch.randn(N, C + 64, dtype=torch.bfloat16, device="cuda")  # the layer passes a column slice
    x = proj[:, :C]
    weight = torch.randn(C, W, dtype=torch.bfloat16, device="cuda")
    pool = torch.randn(SLOTS, C, W - 1, device="cuda").to(state_dtype)
    slots = torch.randperm(SLOTS - 1, device="cuda")[:N]
    return x, weight, pool, slots


@pytest.mark.parametrize("N", [1, 16, 64])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16-state", "fp32-state"])
def test_triton_conv_step_matches_reference(N: int, state_dtype: torch.dtype) -> None:
    x, weight, pool, slots = _inputs(N, state_dtype)
    ref_pool = pool.cpu()
    conv.last_backend.clear()
    y = causal_conv1d(x, weight, pool, torch.arange(N + 1, device="cuda"), slots)
    assert conv.last_backend == {"causal_conv1d": "triton"}
    ref_y = naive.causal_conv1d(x.cpu(), weight.cpu(), ref_pool, torch.arange(N + 1), slots.cpu())
    torch.testing.assert_close(y.cpu().float(), ref_y.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(pool.cpu(), ref_pool), "only the batch's slots move, each by exactly one token"


def test_triton_conv_step_replays_in_a_cuda_graph() -> None:
    x, weight, pool, slots = _inputs(16, torch.bfloat16)
    cu = torch.arange(17, device="cuda")
    causal_conv1d(x, weight, pool.clone(), cu, slots)  # compile outside the capture
    start = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = causal_conv1d(x, weight, pool, cu, slots)
    pool.copy_(start)
    graph.replay()
    ref_pool = start.cpu()
    ref_y = naive.causal_conv1d(x.cpu(), weight.cpu(), ref_pool, cu.cpu(), slots.cpu())
    torch.testing.assert_close(y.cpu().float(), ref_y.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(pool.cpu(), ref_pool)
