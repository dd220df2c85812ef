"""The small fused ops of a decode step (attention-residual prefix update + mix + RMSNorm, MoE routing, KDA
gate, SiTU-GLU) at the K3 rank slice's shapes: device time per call of the Triton kernel and of the torch reference,
each replayed from a CUDA graph (as a decode step replays them), with the kernel launches each graph holds.

    python benchmarks/gpu_small_ops.py [--batch 1,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from k3serve.kernels._backend import reference_kernels
from k3serve.kernels.attn_res import attn_res_aggregate
from k3serve.kernels.kda import kda_gate
from k3serve.kernels.moe import select_experts, situ_glu

CALLS = 50  # calls per graph: the per-call time is the graph's replay time over CALLS


def _graph_us(fn: Callable[[], object]) -> tuple[float, int]:
    """(device us per call, kernels per call) of fn replayed from a CUDA graph of CALLS calls."""
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return start.elapsed_time(end) * 1000 / (20 * CALLS), round(kernels / CALLS)


def _ops(T: int) -> dict[str, Callable[[], object]]:
    dev = "cuda"
    sources = torch.randn(2, T, 7168, device=dev).bfloat16()
    score_w, norm_w = torch.randn(7168, device=dev) / 85, torch.ones(7168, device=dev).bfloat16()
    layer_out = torch.randn(T, 7168, device=dev).bfloat16()
    logits, bias = torch.randn(T, 896, device=dev), torch.randn(896, device=dev) * 0.1
    f, a_log, dt_bias = torch.randn(T, 12, 128, device=dev).bfloat16(), torch.randn(12, device=dev), torch.randn(1536, device=dev)
    gate_up = torch.randn(T, 1536, device=dev).bfloat16()  # the shared experts' stacked gate|up at TP8
    return {
        "attn_res add + mix + rms_norm (S=2, D=7168)":
            lambda: attn_res_aggregate(sources, score_w, 1e-6, norm_w, 1e-5, layer_out),
        "select_experts (E=896, top 16)": lambda: select_experts(logits, bias, 16, True, 2.446),
        "kda_gate (12 heads x 128, bounded)": lambda: kda_gate(f, a_log, dt_bias, -5.0),
        "situ_glu (I=768, stacked gate|up)": lambda: situ_glu(gate_up[:, :768], gate_up[:, 768:], 4.0, 25.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for T in (int(b) for b in args.batch.split(",")):
        for name, fn in _ops(T).items():
            triton_us, triton_kernels = _graph_us(fn)
            with reference_kernels():
                ref_us, ref_kernels = _graph_us(fn)
            rows.append({"op": name, "batch": T, "triton_us": triton_us, "triton_kernels": triton_kernels,
                         "reference_us": ref_us, "reference_kernels": ref_kernels})
            print(f"batch {T:4d}  {name:40s} triton {triton_us:7.2f} us ({triton_kernels} kernels)   "
                  f"reference {ref_us:7.2f} us ({ref_kernels} kernels)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
