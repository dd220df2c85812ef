"""The KDA short conv of a prefill step at K3's rank shape (q|k|v of 12 heads x 128 = 4608 channels at TP8, kernel 4):
the Triton prefill kernel vs the torch reference loop it replaces, and the memory each holds beyond its inputs.

    python benchmarks/gpu_conv_prefill.py [--out gpu_conv_prefill.json] [--smoke]

Rows (times in us, median of CUDA-event timings with L2 flushed; `graph` = a one-call CUDA graph's replay):
  step8K   an 8K-token mixed step: 4 decode rows, then chunks of 2, 3, 4089, 2048 and 2046 tokens on warm slots
  seq32K   one 32K-token chunk: the reference's worst case, its [L, C, W] fp32 products of the whole sequence
Both forms run as the KDA layer calls them: the reference with host indices (the loop the engine ran before), the
kernel with the batch's chunk plan and device indices. `peak_MiB` = the allocator's peak during one call minus
what was allocated before it (the output included). Floor = reading x and writing y once at the copy bandwidth
measured in this run. Every timed kernel is first checked against the reference. --smoke (tiny shapes; off CUDA
both columns are the reference) checks the script only."""

from __future__ import annotations

import torch

from _gpu_common import ceilings, check, device, floor_us, graph_us, parse_args, rel_err, report, time_ms, x_floor

C, W, SLOTS = 4608, 4, 16
STEPS = {"step8K": [1, 1, 1, 1, 2, 3, 4089, 2048, 2046], "seq32K": [32768]}
SMOKE_STEPS = {"step8K": [1, 2, 3, 70], "seq32K": [130]}
TOL = 2**-7  # one bf16 rounding


def peak_bytes(fn, dev: torch.device) -> int | None:
    """Bytes the allocator held at its peak during fn() beyond what it held before."""
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def row(name: str, lens: list[int], dev: torch.device, ceil: dict[str, float], channels: int) -> dict:
    from k3serve.kernels import conv
    from k3serve.kernels.conv import causal_conv1d, naive
    from k3serve.kernels.kda import CHUNK_SIZE, plan_chunks

    T = sum(lens)
    x = torch.randn(T, channels + 268, device=dev, dtype=torch.bfloat16)[:, :channels]  # the projection's slice
    weight = torch.randn(channels, W, device=dev)
    pool = torch.randn(SLOTS, channels, W - 1, device=dev).to(torch.bfloat16)
    slots_host = torch.randperm(SLOTS)[: len(lens)]
    slots = slots_host.to(dev)
    plan = plan_chunks(lens, True, None, CHUNK_SIZE, dev)
    cu_host = torch.tensor([0, *lens]).cumsum(0)

    def ours() -> torch.Tensor:
        return causal_conv1d(x, weight, pool, plan.cu_seqlens, slots, "silu", plan=plan)

    def reference() -> torch.Tensor:
        return naive.causal_conv1d(x, weight, pool, cu_host, slots_host, "silu")

    start = pool.clone()
    y = ours()
    assert conv.last_backend["causal_conv1d"] == ("triton_prefill" if dev.type == "cuda" else "naive")
    new_state = pool.clone()
    pool.copy_(start)
    check(f"{name} y", rel_err(reference(), y), TOL)
    if not torch.equal(pool, new_state):
        raise SystemExit(f"{name}: the kernel's new slot states differ from the reference's; not timing it")
    ours_peak, ref_peak = peak_bytes(ours, dev), peak_bytes(reference, dev)
    ours_us, ref_us = time_ms(ours, dev) * 1e3, time_ms(reference, dev) * 1e3
    floor = floor_us(2 * T * channels * x.element_size(), 0, ceil)
    mib = (lambda b: None if b is None else round(b / 2**20, 1))
    return {"shape": f"{name} T{T} N{len(lens)} C{channels}", "floor": floor, "ours": ours_us, "ours_graph": graph_us(ours, dev),
            "reference": ref_us, "speedup": f"{ref_us / ours_us:.1f}x", "x_floor": x_floor(ours_us, floor),
            "ours_peak_MiB": mib(ours_peak), "reference_peak_MiB": mib(ref_peak)}


def main() -> None:
    args = parse_args(__doc__)
    dev = device(args.smoke)
    ceil = ceilings(dev, args.smoke)
    steps, channels = (SMOKE_STEPS, 300) if args.smoke else (STEPS, C)
    rows = [row(name, lens, dev, ceil, channels) for name, lens in steps.items()]
    report("KDA short conv, prefill step (bf16, silu)", ["shape", "floor", "ours", "ours_graph", "reference", "speedup",
           "x_floor", "ours_peak_MiB", "reference_peak_MiB"], rows, ceil, args.out, dev)


if __name__ == "__main__":
    main()
