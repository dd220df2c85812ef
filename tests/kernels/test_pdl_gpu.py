"""Programmatic dependent launch (kernels/_pdl.py) on the device: on sm_90+ our decode kernels are built
with griddepcontrol and launched with the PDL attribute, and a chain of dependent launches (norm -> skinny
GEMM with its L2 prefetch -> norm -> ...) captured in a CUDA graph gives bit for bit what the same chain
gives launched plainly. A kernel that read its input before its wait would read the previous kernel's
output half-written there, and differ."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels.linear import linear
from k3serve.kernels.norm import rms_norm

pytestmark = pytest.mark.gpu

OFF = {"PDL": False, "launch_pdl": False}


def test_launch_options_follow_the_device_and_the_switch() -> None:
    from k3serve.kernels._pdl import launch_options, pdl_disabled

    on_gpu = torch.zeros(1, device="cuda")
    assert torch.cuda.get_device_capability() >= (9, 0), "the GPU machine is an H200"
    assert launch_options(on_gpu) == {"PDL": True, "launch_pdl": True}
    with pdl_disabled():
        assert launch_options(on_gpu) == OFF
    assert launch_options(on_gpu)["PDL"], "the switch is restored after the block"
    assert launch_options(torch.zeros(1)) == OFF


def _chain(x: torch.Tensor, weights: list[torch.Tensor], norm_weight: torch.Tensor) -> torch.Tensor:
    """Each step's input is the step before's output: norm, then a 7168-wide projection, back to 7168."""
    for w_in, w_out in zip(weights[::2], weights[1::2]):
        x = linear(linear(rms_norm(x, norm_weight, 1e-6), w_in), w_out)
    return x


def _graph(fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    fn()  # eager first: the skinny GEMM times its tiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_a_dependent_chain_in_a_graph_matches_plain_launches_bit_for_bit() -> None:
    from k3serve.kernels._pdl import pdl_disabled
    from k3serve.kernels.linear import triton_skinny
    from k3serve.kernels.norm import triton_norm

    torch.manual_seed(0)
    D = 7168
    weights = [(torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
               for _ in range(4) for n, k in ((3648, D), (D, 3648))]
    norm_weight = torch.randn(D, device="cuda").bfloat16()
    x = torch.randn(1, D, device="cuda").bfloat16()
    with pdl_disabled():
        want = _chain(x, weights, norm_weight)
        plain_graph, plain_out = _graph(lambda: _chain(x, weights, norm_weight))
    graph, out = _graph(lambda: _chain(x, weights, norm_weight))
    for _ in range(20):  # replays race if a wait is missing: more chances to see it
        graph.replay()
        plain_graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(plain_out, want)

    for kernel in (triton_skinny._skinny_kernel, triton_norm._norm_kernel):
        compiled = list(kernel.device_caches[torch.cuda.current_device()][0].values())
        with_pdl = [k for k in compiled if k.metadata.launch_pdl]
        assert with_pdl and all("griddepcontrol.wait" in k.asm["ptx"] for k in with_pdl), kernel.fn.__name__
        assert any(not k.metadata.launch_pdl and "griddepcontrol" not in k.asm["ptx"] for k in compiled)
    prefetching = [k for k in triton_skinny._skinny_kernel.device_caches[torch.cuda.current_device()][0].values()
                   if "cp.async.bulk.prefetch.L2" in k.asm["ptx"]]
    assert prefetching, "the skinny GEMM asks its first weight blocks into L2 before the wait"
