"""Shared by benchmarks/gpu_*.py: the two ceilings measured in the same run, timing, the table.

Timing: CUDA events through triton.testing.do_bench (it clears a 256 MB buffer before every run, so
small inputs are read from HBM, not L2), warm-up first, median of the timed runs. Two graph timings:
`graph_ms` replays a graph of one call, so every sample also pays the graph's own launch (`graph_launch_us`
says how much); `in_graph_us` is one call amid a graph of many over copies of the operands larger than L2,
what the op costs inside a decode step's graph. `--smoke` runs the same code on tiny shapes (on the CPU,
with host timers) to check the script, not to measure."""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """--out and --smoke, plus whatever `extra` adds to the parser."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the rows and ceilings as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device: checks the script only")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def device(smoke: bool) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not smoke:
        sys.exit("needs a CUDA device (or --smoke)")
    return torch.device("cpu")


def use_triton_interpreter() -> None:
    """The smoke without CUDA: Triton's interpreter (switched on before triton is first imported), with the tests'
    fix for numpy >= 2.4 scalars (tests/_triton_interpret.py)."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _triton_interpret import _fix_scalar_index

    _fix_scalar_index()


def time_ms(fn, dev: torch.device, rep_ms: int = 100) -> float:
    """Median milliseconds of fn()."""
    if dev.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_ms(fn, dev: torch.device) -> float | None:
    """Median ms of a CUDA-graph replay of fn (no launch gaps); None if fn cannot be captured."""
    if dev.type != "cuda":
        return None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return time_ms(graph.replay, dev)
    except Exception as exc:  # noqa: BLE001 - a capture failure only drops this column
        print(f"graph capture failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        torch.cuda.synchronize()
        return None


L2_SPAN = 128 * 10**6  # bytes of operand copies an in-graph timing cycles through: the H200's 50 MB L2, 2.5 times


def l2_copies(bytes_per_call: float, dev: torch.device) -> int:
    """How many copies of a call's operands `in_graph_us` cycles through: together at least L2_SPAN, so no call
    finds its operands left in L2 by the calls before it; at least 2. Off CUDA 2 (the smoke only runs them)."""
    if dev.type != "cuda":
        return 2
    return max(2, math.ceil(L2_SPAN / bytes_per_call))


def graph_us(fn, dev: torch.device) -> float | None:
    """`graph_ms` in us."""
    ms = graph_ms(fn, dev)
    return None if ms is None else ms * 1e3


def in_graph_us(calls: list, dev: torch.device, per_graph: int = 16) -> float | None:
    """Median us of one call inside a CUDA graph of max(per_graph, len(calls)) calls cycling through `calls` (the
    same op on copies of its operands, together larger than L2): what the op costs amid a decode step's graph,
    without `graph_ms`'s one launch of the whole graph in every sample, nor an L2 still warm from the call before.
    Off CUDA (the smoke): host time of each call once."""
    if dev.type != "cuda":
        return time_ms(lambda: [call() for call in calls], dev) * 1e3 / len(calls)
    n = max(per_graph, len(calls))
    ms = graph_ms(lambda: [calls[i % len(calls)]() for i in range(n)], dev)
    return None if ms is None else ms * 1e3 / n


def graph_launch_us(dev: torch.device) -> float | None:
    """Median us of a one-call graph of a one-element fill: what every `graph_ms` sample pays besides the op."""
    one = torch.empty(1, device=dev)
    return graph_us(lambda: one.fill_(0.0), dev)


def graph_launch_note(us: float | None) -> str:
    return (f"A one-call graph of a one-element fill takes {fmt(us)} us: about what every `graph_1call` sample pays "
            "on top of the op (the graph's launch); `in_graph` = one call amid a graph of many over operand copies "
            "larger than L2.")


def check_finite(name: str, *tensors: torch.Tensor) -> None:
    """After timing an op that updates its operands in place: thousands of steps must not have drifted to inf/NaN."""
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise SystemExit(f"{name}: inf/NaN after the timed calls; the timings above ran on a diverged state")


def ceilings(dev: torch.device, smoke: bool) -> dict[str, float]:
    """Device copy bandwidth (bytes read + written per second) and bf16 matmul rate on random data."""
    n = (1 << 16) if smoke else (1 << 30)  # 1 GiB of bf16 each way on the GPU
    src = torch.randn(n // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = time_ms(lambda: dst.copy_(src), dev) / 1e3
    size = 256 if smoke else 8192
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    mm_s = time_ms(lambda: a @ b, dev) / 1e3
    return {"copy_bytes_per_s": 2 * src.numel() * 2 / copy_s, "bf16_flop_per_s": 2 * size**3 / mm_s}


def floor_us(bytes_moved: float, flops: float, ceil: dict[str, float]) -> float:
    return 1e6 * max(bytes_moved / ceil["copy_bytes_per_s"], flops / ceil["bf16_flop_per_s"])


def x_floor(us: float | None, floor: float) -> str:
    """us / floor as a table cell ("-" where the timing is missing)."""
    return "-" if us is None else f"{us / floor:.2f}"


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(name: str, err: float, tol: float) -> None:
    if not err <= tol:
        raise SystemExit(f"{name}: relative error {err:.3e} > {tol:.1e}; not timing a wrong kernel")


def fmt(x: float | int | None) -> str:
    return "-" if x is None else str(x) if isinstance(x, int) else f"{x:.1f}"


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def print_table(title: str, columns: list[str], rows: list[dict], ceil: dict[str, float], dev: torch.device,
                note: str = "") -> None:
    """One markdown table (times in us), titled with the device and the ceilings of this run, and a note under it."""
    print(f"\n### {title}  ({device_name(dev)}, {datetime.date.today()}; copy {ceil['copy_bytes_per_s'] / 1e12:.2f} "
          f"TB/s, bf16 matmul {ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s measured in this run)\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(row[c] if isinstance(row[c], str) else fmt(row[c]) for c in columns) + " |")
    if note:
        print(f"\n{note}")


def report(title: str, columns: list[str], rows: list[dict], ceil: dict[str, float], out: Path | None,
           dev: torch.device, note: str = "", extra: dict | None = None) -> None:
    """Print ONE markdown table (and its note) and write everything, `extra` too, as JSON."""
    print_table(title, columns, rows, ceil, dev, note)
    if out is not None:
        out.write_text(json.dumps({"title": title, "device": device_name(dev), "ceilings": ceil, "rows": rows,
                                   **(extra or {})}, indent=1))
