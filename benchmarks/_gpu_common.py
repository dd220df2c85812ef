"""Shared by benchmarks/gpu_*.py: the two ceilings measured in the same run, timing, the table.

Timing: CUDA events through triton.testing.do_bench (it clears a 256 MB buffer before every run, so
small inputs are read from HBM, not L2), warm-up first, median of the timed runs. `--smoke` runs the
same code on tiny shapes (on the CPU, with host timers) to check the script, not to measure."""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable
import json
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


def in_graph_us(calls: list, dev: torch.device, per_graph: int = 16) -> float | None:
    """Median us of one call inside a CUDA graph of per_graph calls cycling through `calls` (the same op on
    copies of its operands, together larger than L2): what the op costs amid a decode step's graph, without
    `graph_ms`'s one launch of the whole graph in every sample, nor an L2 still warm from the call before."""
    ms = graph_ms(lambda: [calls[i % len(calls)]() for i in range(per_graph)], dev)
    return None if ms is None else ms * 1e3 / per_graph


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


def print_table(title: str, columns: list[str], rows: list[dict], ceil: dict[str, float], dev: torch.device) -> None:
    """One markdown table (times in us), titled with the device and the ceilings of this run."""
    print(f"\n### {title}  ({device_name(dev)}, {datetime.date.today()}; copy {ceil['copy_bytes_per_s'] / 1e12:.2f} "
          f"TB/s, bf16 matmul {ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s measured in this run)\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(row[c] if isinstance(row[c], str) else fmt(row[c]) for c in columns) + " |")


def report(title: str, columns: list[str], rows: list[dict], ceil: dict[str, float], out: Path | None,
           dev: torch.device) -> None:
    """Print ONE markdown table and write everything as JSON."""
    print_table(title, columns, rows, ceil, dev)
    if out is not None:
        out.write_text(json.dumps({"title": title, "device": device_name(dev), "ceilings": ceil, "rows": rows},
                                  indent=1))
