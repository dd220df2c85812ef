"""The short conv on the GPU at K3's per-rank shape (q|k|v of 12 heads x 128 = 4608 channels, kernel 4), through
`causal_conv1d` as the KDA layer calls it: the one-token step is one Triton launch that replays inside a CUDA graph,
and a prefill step is one Triton launch over the batch's chunk plan that reads nothing back from the device; both
match the reference."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels import conv
from k3serve.kernels.conv import causal_conv1d, naive
from k3serve.kernels.kda import CHUNK_SIZE, plan_chunks

from _close import assert_close

pytestmark = pytest.mark.gpu

C, W, SLOTS = 4608, 4, 80


def _inputs(T: int, N: int, state_dtype: torch.dtype):
    """T tokens of N sequences: x as the layer passes it (a column slice of the projection), its fp32 weight, a pool
    whose every slot holds an old state, N distinct slots."""
    proj = torch.randn(T, C + 64, dtype=torch.bfloat16, device="cuda")
    x = proj[:, :C]
    weight = torch.randn(C, W, device="cuda")
    pool = torch.randn(SLOTS, C, W - 1, device="cuda").to(state_dtype)
    slots = torch.randperm(SLOTS - 1, device="cuda")[:N]
    return x, weight, pool, slots


@pytest.mark.parametrize("N", [1, 16, 64])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16-state", "fp32-state"])
def test_triton_conv_step_matches_reference(N: int, state_dtype: torch.dtype) -> None:
    x, weight, pool, slots = _inputs(N, N, state_dtype)
    ref_pool = pool.cpu()
    conv.last_backend.clear()
    y = causal_conv1d(x, weight, pool, torch.arange(N + 1, device="cuda"), slots)
    assert conv.last_backend == {"causal_conv1d": "triton"}
    ref_y = naive.causal_conv1d(x.cpu(), weight.cpu(), ref_pool, torch.arange(N + 1), slots.cpu())
    torch.testing.assert_close(y.cpu().float(), ref_y.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(pool.cpu(), ref_pool), "only the batch's slots move, each by exactly one token"


def test_triton_conv_step_replays_in_a_cuda_graph() -> None:
    x, weight, pool, slots = _inputs(16, 16, torch.bfloat16)
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


# An 8K-token mixed step as the runner packs it: decode rows first, then chunks that continue their slot with
# fewer tokens than it keeps (2), exactly as many (3), and long ones over many 64-token blocks.
K3_STEP_LENS = [1, 1, 1, 2, 3, 4089, 2048, 2047]


@pytest.mark.parametrize("activation", ["silu", None], ids=lambda a: f"act-{a}")
def test_triton_prefill_matches_reference_without_a_host_sync(activation: str | None) -> None:
    x, weight, pool, slots = _inputs(sum(K3_STEP_LENS), len(K3_STEP_LENS), torch.bfloat16)
    plan = plan_chunks(K3_STEP_LENS, True, None, CHUNK_SIZE, x.device)  # the batch's, as the KDA layer passes it
    ref_pool = pool.clone()
    causal_conv1d(x, weight, pool.clone(), plan.cu_seqlens, slots, activation, plan=plan)  # compile (syncs)
    torch.cuda.synchronize()
    conv.last_backend.clear()
    torch.cuda.set_sync_debug_mode("error")  # a host sync raises
    try:
        y = causal_conv1d(x, weight, pool, plan.cu_seqlens, slots, activation, plan=plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert conv.last_backend == {"causal_conv1d": "triton_prefill"}
    ref_y = naive.causal_conv1d(x, weight, ref_pool, plan.cu_seqlens.cpu(), slots.cpu(), activation)
    # one bf16 rounding apart at most; atol: the order of a sum of four fp32 products (FMA here), near zero
    assert_close("y", ref_y, y, 1e-5, 2**-7)
    assert torch.equal(pool, ref_pool), "the batch's slots keep their last 3 inputs, every other slot is untouched"
