"""Where a decode step's device time goes: torch.profiler (CUDA activity) over a few steps, each step's
kernels grouped into op families by kernel name, against the step's wall time and its device span.

Used by benchmarks/gpu_engine.py `--profile`. The gap between a CUDA-graph step and its bytes floor is
one of: kernels that are slow for what they move (a family's time), too many small kernels (kernels per
step x a few us each), or idle device time between kernels (span - busy) and host time around the
replay (wall - span). Families come from kernel names: torch's generic kernels (elementwise, reduce,
copy) do not say which layer launched them, so the norms' fp32 math shows up under "reductions" and
"elementwise", beside the KDA conv and gate math."""

from __future__ import annotations

import math
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

COPIES = "host<->device copies, memsets"
GAP_S = 0.01  # idle time before each profiled step: longer than any gap inside a step, so it tells steps apart
# First match wins. Triton kernels carry their jit function's name (kernels/*/triton_*.py, fla).
FAMILIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((family, re.compile(pattern)) for family, pattern in (
    ("KDA decode + short conv (Triton)", r"^_kda_decode_kernel|fused_recurrent|^_conv_decode_kernel"),
    ("MLA decode + cache write (Triton)", r"^_decode_kernel|^_merge_kernel|^_write_kernel"),
    ("MoE experts (Triton MXFP4)", r"^_up_kernel|^_down_kernel|^(gemv|mma)_(up|down)_kernel|^route_kernel"),
    ("fused small ops (Triton: attn-res mix, router, gate, GLU, norms)",
     r"^_(attn_res|router|gate|glu|norm)_kernel"),
    ("KDA prefill (fla)", r"kda|l2norm|chunk_|_checkpoint_kernel"),
    ("GEMMs (projections, router, lm_head: Triton skinny, cuBLAS)",
     r"(?i)^_skinny_kernel|gemm|gemv|nvjet|cutlass|xmma|splitk|cublas|dot_kernel"),
    ("reductions (norms, router top-k, sums)", r"(?i)reduce_kernel|norm|softmax|topk|sort|scan"),
    (COPIES, r"^Memcpy|^Memset"),
    ("elementwise, casts, indexing (torch)", r"(?i)elementwise|index|scatter|gather|fill|copy|cat"),
))
OTHER = "other"


def family_of(kernel_name: str) -> str:
    return next((family for family, pattern in FAMILIES if pattern.search(kernel_name)), OTHER)


@dataclass(frozen=True)
class DeviceEvent:
    name: str
    start_us: float
    end_us: float


def _device_events(prof, dev: torch.device) -> list[DeviceEvent]:
    """CUDA kernels, copies and memsets in start order; on a CPU (--smoke) the top-level ops stand in."""
    from torch.autograd import DeviceType

    if dev.type == "cuda":
        chosen = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        chosen = [e for e in prof.events() if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    return sorted((DeviceEvent(e.name, e.time_range.start, e.time_range.end) for e in chosen),
                  key=lambda e: e.start_us)


def _steps(events: list[DeviceEvent], window_us: float, gap_us: float) -> tuple[list[list[DeviceEvent]], int]:
    """Events grouped into steps by the idle gaps the profiler loop leaves between them, and the number of
    events dropped for impossible timestamps (CUPTI can hand back a session's first records with a wrong
    clock: end before start, or far outside the session)."""
    if not events:
        return [], 0
    middle = statistics.median(e.start_us for e in events)
    valid = [e for e in events if e.end_us >= e.start_us and abs(e.start_us - middle) <= window_us]
    groups: list[list[DeviceEvent]] = []
    last_end = -math.inf
    for e in valid:
        if e.start_us - last_end > gap_us:
            groups.append([])
        groups[-1].append(e)
        last_end = max(last_end, e.end_us)
    return groups, len(events) - len(valid)


def profile_step(step: Callable[[], object], dev: torch.device, num_steps: int = 6, top: int = 15) -> dict:
    """Profile `num_steps` synchronized steps, each after an idle gap of GAP_S; per step: kernel count, busy
    time, span, wall, families, top kernels. Only the steps with the most common event count are used (a
    step that lost records at the session's start, or was split by a long stall, is left out:
    `event_counts` lists them all)."""
    from torch.profiler import ProfilerActivity, profile

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    walls_ms = []
    sync()
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            time.sleep(GAP_S)
            start = time.perf_counter()
            step()
            sync()
            walls_ms.append((time.perf_counter() - start) * 1e3)
    groups, num_dropped = _steps(_device_events(prof, dev), (time.perf_counter() - started) * 1e6, GAP_S * 1e6 / 2)
    counts = [len(g) for g in groups]
    result = {"num_steps": num_steps, "event_counts": counts, "dropped_events": num_dropped,
              "wall_ms": statistics.median(walls_ms)}
    if not groups:
        return {**result, "events_per_step": 0}
    per_step = statistics.mode(counts)
    steps = [g for g in groups if len(g) == per_step]
    spans_ms = [(max(e.end_us for e in s) - s[0].start_us) / 1e3 for s in steps]
    busy_ms = [sum(e.end_us - e.start_us for e in s) / 1e3 for s in steps]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in steps:
        for e in s:
            by_name[e.name][0] += (e.end_us - e.start_us) / len(steps)
            by_name[e.name][1] += 1 / len(steps)
    busy_us = sum(total for total, _ in by_name.values())
    families: dict[str, dict] = {}
    for name, (total_us, calls) in by_name.items():
        fam = families.setdefault(family_of(name), {"us_per_step": 0.0, "events_per_step": 0.0})
        fam["us_per_step"] += total_us
        fam["events_per_step"] += calls
    for fam in families.values():
        fam["share"] = fam["us_per_step"] / busy_us
    copies = families.get(COPIES, {}).get("events_per_step", 0.0)
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])
    return {
        **result,
        "steps_used": len(steps),
        "events_per_step": per_step,
        "kernels_per_step": per_step - copies,
        "device_span_ms": statistics.median(spans_ms),
        "kernel_busy_ms": statistics.median(busy_ms),
        "gaps_ms": statistics.median(span - busy for span, busy in zip(spans_ms, busy_ms)),
        "families": dict(sorted(families.items(), key=lambda item: -item[1]["us_per_step"])),
        "top_kernels": [{"name": name, "family": family_of(name), "us_per_step": total_us, "calls_per_step": calls,
                         "share": total_us / busy_us} for name, (total_us, calls) in ranked[:top]],
    }


def print_profile(title: str, prof: dict, floor_ms: float | None) -> None:
    """The profile as markdown: one summary line, the families, the top kernels."""
    print(f"\n#### {title}\n")
    if not prof.get("events_per_step"):
        print(f"no device events seen in {prof['num_steps']} profiled steps (wall {prof['wall_ms']:.2f} ms)")
        return
    floor = ("" if floor_ms is None
             else f", floor {floor_ms:.3f} ms (busy = {prof['kernel_busy_ms'] / floor_ms:.1f}x floor)")
    print(f"per step: wall {prof['wall_ms']:.2f} ms, device span {prof['device_span_ms']:.2f} ms, kernels busy "
          f"{prof['kernel_busy_ms']:.2f} ms, gaps between kernels {prof['gaps_ms']:.2f} ms, "
          f"{prof['kernels_per_step']:.0f} kernels + {prof['events_per_step'] - prof['kernels_per_step']:.0f} "
          f"copies/memsets{floor}; {prof['steps_used']} of {prof['num_steps']} steps used (event counts "
          f"{prof['event_counts']}, {prof['dropped_events']} events with impossible timestamps dropped)")
    print("\n| family | us / step | share of busy | kernels / step |\n|---|---|---|---|")
    for family, fam in prof["families"].items():
        print(f"| {family} | {fam['us_per_step']:.1f} | {100 * fam['share']:.1f}% | {fam['events_per_step']:.0f} |")
    print("\n| kernel | family | us / step | calls / step | share of busy |\n|---|---|---|---|---|")
    for k in prof["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        print(f"| `{name}` | {k['family']} | {k['us_per_step']:.1f} | {k['calls_per_step']:.0f} | "
              f"{100 * k['share']:.1f}% |")
