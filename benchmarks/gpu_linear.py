"""The projections of a K3 decode step (one rank at TP8, hidden 7168) at 1-16 rows: the Triton skinny GEMM
(kernels/linear/triton_skinny.py, tiles by the rule of kernels/linear/tile_rule.py) against cuBLAS, both replayed
from CUDA graphs; then every candidate tiling of each streamed weight at 1 and 16 rows (a BLOCK_T bucket each),
to check the rule: its pick, the fastest candidate of the same run, and how far apart they are.

    python benchmarks/gpu_linear.py [--out gpu_linear.json] [--smoke]

ours = triton_skinny.linear (what kernels.linear.linear runs for these shapes; `dispatch` says what it picks
for the shape); anchor = F.linear (cuBLAS), same run. Floor = weight bytes / measured copy bandwidth (the
weight streams once; x and the output are noise). Two timings: `ours`/`cublas` replay a graph of one call
after an L2 flush (each sample pays the graph's launch); `*_in_graph` is one call amid a graph of 16 that
cycle through copies of the weight larger than L2 together, as in a decode step, and `read_in_graph` the
same for a kernel that only reads the weight once (the practical floor of one launch: `ours_vs_read`).
The router rows (fp32 logits) compare ours from the bf16 weight with the path before kernels/linear (an fp32 GEMV over an fp32 copy of the weight) and with
torch.mm(out_dtype=fp32) (cuBLAS, which linear ran for them before fp32 outputs took the skinny kernel too).
--smoke: tiny shapes on the CPU through the Triton interpreter (fp16: it cannot multiply bf16), the rule's
tiles for an H200 (132 SMs, 227 KB)."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from _gpu_common import (ceilings, check, device, device_name, floor_us, graph_ms, in_graph_us, parse_args,
                         print_table, rel_err, time_ms)

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS / "kernels"), str(TESTS)]  # the shapes (_linear_cases.py), the interpreter fix

from _linear_cases import k3_rank_weights  # noqa: E402

SMOKE_WEIGHTS = [("smoke", 96, 256), ("smoke split", 40, 512)]
ROWS = (1, 2, 4, 8, 16)
RULE_ROWS = (1, 16)  # one row count a BLOCK_T bucket: 1-8 rows run one binary, 9-16 another
H200 = (132, 232448)  # (SMs, shared memory per block): the device the smoke's tiles are for
TOL = 1e-2  # bf16 output rounding, relative to the fp32 sums of the exact products


def _device_us(fn, dev: torch.device) -> float | None:
    """Graph-replayed us on CUDA (None if the capture failed), host-timed on the smoke's CPU."""
    ms = graph_ms(fn, dev) if dev.type == "cuda" else time_ms(fn, dev)
    return None if ms is None else ms * 1e3


def _ratio(us: float | None, floor: float) -> str:
    return "-" if us is None else f"{us / floor:.2f}"


def _ours(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype):
    """(call, tiles) of our kernel: triton_skinny.linear and the tiles it runs (the first of the rule's order that
    launches); under the interpreter the rule's pick for an H200."""
    from k3serve.kernels.linear import tile_rule, triton_skinny

    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype, device=x.device)
    if x.is_cuda:
        tiles = triton_skinny.launch_first_fitting(x, w, out, triton_skinny.tile_order_for(x, w))
        return (lambda: triton_skinny.linear(x, w, out_dtype)), str(tiles)
    tiles = tile_rule.tile_order(*w.shape, tile_rule.block_t(x.shape[0]), *H200)[0]
    return (lambda: triton_skinny.launch(x, w, out, tiles)), str(tiles)


def _inputs(N: int, K: int, T: int, dev: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(T, K, device=dev).to(dtype), (torch.randn(N, K, device=dev) / K**0.5).to(dtype)


def _in_graph(x: torch.Tensor, w: torch.Tensor, dev: torch.device) -> dict[str, float | None]:
    """ours, cuBLAS and a read-only kernel, each one call amid a graph over copies of w (`in_graph_us`)."""
    if dev.type != "cuda":
        return {"ours_in_graph": None, "cublas_in_graph": None, "read_in_graph": None}
    from k3serve.kernels.linear import triton_skinny

    copies = [w] + [w.clone() for _ in range(max(1, -(-L2_SPAN // (w.numel() * w.element_size()))))]
    sink = torch.empty(READ_PROGRAMS_PER_SM * torch.cuda.get_device_properties(dev).multi_processor_count,
                       device=dev)
    read = lambda c: _read_kernel()[(sink.numel(),)](c, sink, c.numel(), BLOCK=2048, num_warps=4)  # noqa: E731
    return {"ours_in_graph": in_graph_us([lambda c=c: triton_skinny.linear(x, c, x.dtype) for c in copies], dev),
            "cublas_in_graph": in_graph_us([lambda c=c: F.linear(x, c) for c in copies], dev),
            "read_in_graph": in_graph_us([lambda c=c: read(c) for c in copies], dev)}


L2_SPAN = 128 * 10**6  # bytes of weight copies a graph cycles through: more than the H200's 50 MB L2, twice over
READ_PROGRAMS_PER_SM = 16  # the read-only kernel's grid: the fastest of 4, 8, 16 on an H200 (3.87 TB/s at 90 MB)


@functools.cache
def _read_kernel():
    """A kernel that only reads a weight (made on first use: triton is imported after the smoke's interpreter
    switch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(w, sink, n, BLOCK: tl.constexpr):
        """Reads w once (grid-strided blocks), summing so the loads stay."""
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            acc += tl.load(w + i + tl.arange(0, BLOCK), mask=i + tl.arange(0, BLOCK) < n, other=0.0).to(tl.float32)
        tl.store(sink + tl.program_id(0), tl.sum(acc))

    return read_kernel


def _row(name: str, N: int, K: int, T: int, dev: torch.device, ceil: dict, dtype: torch.dtype) -> dict:
    from k3serve.kernels import linear as linear_op

    x, w = _inputs(N, K, T, dev, dtype)
    ours, tiles = _ours(x, w, dtype)
    check(f"{name} T{T}", rel_err(linear_op.naive.linear(x, w, torch.float32), ours()), TOL)
    linear_op.linear(x, w)
    floor = floor_us(w.numel() * w.element_size(), 2 * T * N * K, ceil)
    ours_us, cublas_us = _device_us(ours, dev), _device_us(lambda: F.linear(x, w), dev)
    in_graph = _in_graph(x, w, dev)
    ratio = (None if None in (in_graph["ours_in_graph"], in_graph["read_in_graph"])
             else f"{in_graph['ours_in_graph'] / in_graph['read_in_graph']:.2f}")
    return dict(weight=name, shape=f"{N}x{K}", T=T, ours=ours_us, cublas=cublas_us, **in_graph, ours_vs_read=ratio,
                floor=floor, ours_x_floor=_ratio(ours_us, floor), cublas_x_floor=_ratio(cublas_us, floor),
                ours_TBps="-" if ours_us is None else f"{w.numel() * w.element_size() / ours_us / 1e6:.2f}",
                tiles=tiles, dispatch=linear_op.last_backend["linear"])


def _router_row(N: int, K: int, T: int, dev: torch.device, ceil: dict, dtype: torch.dtype) -> dict:
    """fp32 logits from bf16 x: ours on the bf16 weight vs x.float() @ w_fp32.t() (before) and torch.mm (now)."""
    from k3serve.kernels.linear import naive

    x, w = _inputs(N, K, T, dev, dtype)
    w32 = w.float()
    ours, tiles = _ours(x, w, torch.float32)
    check(f"router T{T}", rel_err(naive.linear(x, w, torch.float32), ours()), 1e-5)
    floor = floor_us(w.numel() * w.element_size(), 2 * T * N * K, ceil)
    ours_us, fp32_us = _device_us(ours, dev), _device_us(lambda: x.float() @ w32.t(), dev)
    mm_us = _device_us(lambda: torch.mm(x, w.t(), out_dtype=torch.float32), dev) if dev.type == "cuda" else None
    return dict(weight="MoE router, fp32 logits", shape=f"{N}x{K}", T=T, ours=ours_us, fp32_gemv=fp32_us,
                mm_out_fp32=mm_us, floor=floor, ours_x_floor=_ratio(ours_us, floor),
                fp32_gemv_x_floor=_ratio(fp32_us, floor), mm_x_floor=_ratio(mm_us, floor), tiles=tiles)


def _rule_row(names: list[str], N: int, K: int, T: int, dev: torch.device, dtype: torch.dtype) -> dict:
    """Every candidate tiling (and the rule's pick) timed on one weight: the pick, the fastest, the pick's margin.
    A candidate the device cannot hold (OutOfResources) is left out; a wrong one stops the run."""
    from triton.runtime.errors import OutOfResources

    from k3serve.kernels.linear import naive, tile_rule, triton_skinny

    x, w = _inputs(N, K, T, dev, dtype)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        sms, smem = props.multi_processor_count, props.shared_memory_per_block_optin
    else:
        sms, smem = H200
    pick = tile_rule.tile_order(N, K, tile_rule.block_t(T), sms, smem)[0]
    ref, out = naive.linear(x, w, torch.float32), torch.empty(T, N, dtype=dtype, device=dev)
    times = {}
    for tiles in dict.fromkeys([pick, *tile_rule.candidates(N, K, sms)]):
        try:
            check(f"{N}x{K} T{T} {tiles}", rel_err(ref, triton_skinny.launch(x, w, out, tiles)), TOL)
        except OutOfResources:
            continue
        times[str(tiles)] = _device_us(lambda tiles=tiles: triton_skinny.launch(x, w, out, tiles), dev)
    timed = {tiles: us for tiles, us in times.items() if us is not None}
    fastest = min(timed, key=timed.get, default="-")
    rule_us = timed.get(str(pick))
    margin = "-" if rule_us is None else f"{100 * (rule_us / timed[fastest] - 1):+.1f}%"
    return dict(weight=" = ".join(names), shape=f"{N}x{K}", T=T, rule=str(pick), rule_us=rule_us, fastest=fastest,
                fastest_us=timed.get(fastest), rule_vs_fastest=margin, candidates=times)


def _use_interpreter() -> None:
    """The smoke on a machine without CUDA: Triton's interpreter (set before triton is first imported), with
    the tests' fix for numpy >= 2.4 scalars (tests/_triton_interpret.py)."""
    os.environ["TRITON_INTERPRET"] = "1"
    from _triton_interpret import _fix_scalar_index

    _fix_scalar_index()


def main() -> None:
    args = parse_args(__doc__)
    dev = device(args.smoke)
    if dev.type == "cpu":
        _use_interpreter()
    torch.manual_seed(0)
    ceil = ceilings(dev, args.smoke)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    if args.smoke:
        weights, router, rows_of_x = SMOKE_WEIGHTS, ("smoke router", 32, 512), (1, 11)
    else:
        weights, rows_of_x = k3_rank_weights(), ROWS
        router = next(w for w in weights if w[0] == "MoE router")
    rows = [_row(name, N, K, T, dev, ceil, dtype) for name, N, K in weights for T in rows_of_x]
    columns = ["weight", "shape", "T", "ours", "cublas", "ours_in_graph", "cublas_in_graph", "read_in_graph",
               "ours_vs_read", "floor", "ours_x_floor", "cublas_x_floor", "ours_TBps", "tiles", "dispatch"]
    print_table("Skinny GEMM, out = x @ W^T in bf16 (us, CUDA-graph replay)", columns, rows, ceil, dev)
    router_rows = [_router_row(*router[1:], T, dev, ceil, dtype) for T in rows_of_x]
    router_columns = ["weight", "shape", "T", "ours", "fp32_gemv", "mm_out_fp32", "floor", "ours_x_floor",
                      "fp32_gemv_x_floor", "mm_x_floor", "tiles"]
    print_table("Router logits in fp32 (us, CUDA-graph replay; floor = the bf16 weight's bytes)", router_columns,
                router_rows, ceil, dev)
    from k3serve.kernels.linear import MIN_TRITON_WEIGHT

    streamed = {}  # (N, K) -> names: the weights linear streams through the kernel, each shape once
    for name, N, K in weights:
        if args.smoke or N * K >= MIN_TRITON_WEIGHT:
            streamed.setdefault((N, K), []).append(name)
    rule_rows = [_rule_row(names, N, K, T, dev, dtype) for (N, K), names in streamed.items() for T in RULE_ROWS]
    print_table("The tile rule's pick vs the fastest candidate of this run (us, CUDA-graph replay)",
                ["weight", "shape", "T", "rule", "rule_us", "fastest", "fastest_us", "rule_vs_fastest"], rule_rows,
                ceil, dev)
    if args.out is not None:
        args.out.write_text(json.dumps({"device": device_name(dev), "ceilings": ceil, "rows": rows,
                                        "router_rows": router_rows, "rule_rows": rule_rows}, indent=1))


if __name__ == "__main__":
    main()
