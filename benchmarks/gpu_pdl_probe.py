"""Probe: does Programmatic Dependent Launch (PDL) shorten a CUDA graph of many small dependent kernels, as the
batch-1 decode step is (239 kernels, ~1.8 ms busy against a 0.93 ms bytes floor on the H200)?

    python benchmarks/gpu_pdl_probe.py [--kernels 200] [--weight-kib 2048] [--out pdl.json]

A chain of `--kernels` Triton kernels, each like a decode-step projection at batch 1: it streams its own weight slice
(`--weight-kib`, never written by anyone: a stand-in for a GEMM's weights) and reads the previous kernel's output
vector, then writes its own (y = x + a, a its program's weight sum, so nothing is optimized away and every output depends
fully on the first input). Three ways of launching the same chain, each captured in one CUDA graph, replayed on a
fresh first input and checked against the torch result: a kernel that read its input before the previous one
wrote it would see the previous replay's values, an O(1) error.

    plain      ordinary launches: a kernel starts when the one before has finished
    pdl        `launch_pdl=True`; each kernel waits (`gdc_wait`) before reading the previous output, and lets the next
               one launch (`gdc_launch_dependents`) once it has read its inputs
    pdl+pre    as pdl, but the weight slice is loaded before the wait: the stream of a kernel's weights overlaps the
               tail of the kernel before it (CUTLASS's "weight prefetch" use of PDL)

Prints us per kernel for each, the floor (weight bytes / copy bandwidth measured in the same run) and the gap above it.
Compiled here for sm_90 (the waits where they belong); not yet run on a GPU (written 2026-12-01, no device time
left): first call of the next GPU session."""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from _gpu_common import ceilings, device, fmt, parse_args, report, time_ms

VECTOR = 7168  # K3's hidden size: the vector passed from kernel to kernel
BLOCK = 1024
_VECTOR, _BLOCK = tl.constexpr(VECTOR), tl.constexpr(BLOCK)  # the same, for the kernel


@triton.jit
def _link(x, y, w, weight_elems, USE_GDC: tl.constexpr, PREFETCH: tl.constexpr):
    """One link of the chain: program p sums its share of the weights (a), then y[p's block] = x + a."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    offs = tl.arange(0, _BLOCK)
    per_prog = weight_elems // progs
    acc = tl.zeros([_BLOCK], tl.float32)
    if PREFETCH:  # the weights are nobody's output: stream them before waiting for the previous kernel
        for start in range(0, per_prog, _BLOCK):
            acc += tl.load(w + pid * per_prog + start + offs).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    if not PREFETCH:
        for start in range(0, per_prog, _BLOCK):
            acc += tl.load(w + pid * per_prog + start + offs).to(tl.float32)
    mask = pid * _BLOCK + offs < _VECTOR
    v = tl.load(x + pid * _BLOCK + offs, mask=mask, other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    a = tl.sum(acc, axis=0) * 1e-6
    tl.store(y + pid * _BLOCK + offs, v + a, mask=mask)


def chain(xs: list[torch.Tensor], weights: list[torch.Tensor], mode: str) -> None:
    """Kernel i reads xs[i] (the output of kernel i - 1) and writes xs[i + 1]."""
    programs = triton.cdiv(VECTOR, BLOCK)
    for i, w in enumerate(weights):
        _link[(programs,)](xs[i], xs[i + 1], w, w.numel(), USE_GDC=mode != "plain", PREFETCH=mode == "pdl+pre",
                           launch_pdl=mode != "plain", num_warps=4)


def reference(x0: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    programs = triton.cdiv(VECTOR, BLOCK)
    x = x0.clone()
    for w in weights:
        sums = w.float().view(programs, -1).sum(dim=1) * 1e-6  # program p's weight share
        x = x + sums.repeat_interleave(BLOCK)[:VECTOR]
    return x


def main() -> None:
    def extra(parser):
        parser.add_argument("--kernels", type=int, default=200)
        parser.add_argument("--weight-kib", type=int, default=2048, help="weights a kernel streams (bf16)")

    args = parse_args(__doc__.split("\n\n")[0], extra)
    dev = device(False)
    ceil = ceilings(dev, False)
    programs = triton.cdiv(VECTOR, BLOCK)
    elems = args.weight_kib * 1024 // 2 // (programs * BLOCK) * programs * BLOCK  # whole blocks a program
    weights = [torch.randn(elems, device=dev, dtype=torch.bfloat16) for _ in range(args.kernels)]
    xs = [torch.randn(VECTOR, device=dev)] + [torch.empty(VECTOR, device=dev) for _ in range(args.kernels)]
    floor_us = elems * 2 / ceil["copy_bytes_per_s"] * 1e6
    rows = []
    for mode in ("plain", "pdl", "pdl+pre"):
        try:
            chain(xs, weights, mode)  # compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(xs, weights, mode)
            graph.replay()
            xs[0].copy_(torch.randn(VECTOR, device=dev))  # a fresh input: a stale read shows as an O(1) error
            graph.replay()
            err = (xs[-1] - reference(xs[0], weights)).abs().max().item()
            us = time_ms(graph.replay, dev) * 1e3 / args.kernels
            rows.append(dict(mode=mode, us_per_kernel=us, floor_us=floor_us, gap_us=us - floor_us,
                             max_abs_err=f"{err:.1e}", ok=str(err < 1e-3)))
        except Exception as exc:  # noqa: BLE001 - a mode the driver refuses is a result, not a crash
            rows.append(dict(mode=mode, us_per_kernel=None, floor_us=floor_us, gap_us=None, max_abs_err="-",
                             ok=f"failed: {type(exc).__name__}: {exc}"[:120]))
        print(rows[-1], file=sys.stderr, flush=True)
    report(f"PDL probe: a graph of {args.kernels} dependent kernels, {fmt(elems * 2 / 2**20)} MiB of weights each",
           ["mode", "us_per_kernel", "floor_us", "gap_us", "max_abs_err", "ok"], rows, ceil, args.out, dev)


if __name__ == "__main__":
    main()
