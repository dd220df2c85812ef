"""Where a KDA prefill's time goes: fla's chunk_kda vs ours vs ours + in-pass checkpoint vs fla split, in
one process, by wall clock, device time and host time (issue 7: a checkpoint costs <= 2% over fla).

    python3 benchmarks/gpu_kda_profile.py [--heads 12,32] [--tokens 8192] [--out kda_profile.json] [--smoke]

One sequence of T tokens per head count, fp32 initial state, the K3 bounded gate (gpu_kda.py's inputs).
Variants (each checked against the fp32 torch reference before it is timed):
  fla                 fla's public chunk_kda, device cu_seqlens (its chunk indices cached: fla at its best)
  ours                k3serve chunk_kda, host cu_seqlens, the chunk plan built in the call (gpu_kda.py's `ours`)
  ours_plan           the same with the plan built once, as the engine's KDA layers share one per batch
  ours+ckpt@P         a checkpoint at offset P (mid-chunk T/2+17), plan built in the call
  ours_plan+ckpt@P    the same with the plan built once; P = T/2+17 and T-64 (the scheduler's last block)
  fla_split@P         two fla calls split at P = T/2+17 (the checkpoint is the first call's final state)
Columns (us per call):
  wall    median of CUDA-event timings with the L2 flushed (triton do_bench), best of 2 interleaved rounds:
          gpu_kda.py's number. Back-to-back calls: if the host enqueues slower than the device runs, the
          device waits and this measures the host.
  graph   the call replayed as a CUDA graph (device time, no host, no launch gaps); '-' where the call
          copies its plan from the host (not capturable).
  busy    sum of the call's kernel and copy times (torch.profiler, one call on an idle GPU, median of 5).
  span    first kernel start to last kernel end of that call: span - busy = the device idling between
          launches, i.e. launches arriving slower than the kernels finish.
  host    CPU time to enqueue one call on an idle GPU (perf_counter around the call, no sync; median of 30).
  wall1   one call from its start to a synchronize after it.
Then, per head count, the per-kernel device times of each variant (us per call, launches in brackets) and
the host time of our layers (plan_chunks alone; fla_ops.chunk_kda, which the public entry wraps with its
validation); for the first head count, cProfile of `fla` and `ours_plan+ckpt@mid` (host time by function).
Reading it: wall ~ host (and > busy) says back-to-back calls are host-bound and the difference between
variants is host work; busy / graph differences are device work (the checkpoint kernel itself)."""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from _gpu_common import check, device, device_name, graph_ms, parse_args, rel_err
from _kernel_profile import profile_step
from gpu_kda import LB, TOL, K, V, best_of_interleaved, fla_calls, kda_inputs
from k3serve.kernels import kda
from k3serve.kernels.kda import CHUNK_SIZE, chunk_kda, naive, plan_chunks

HOST_CALLS = 30
PROFILED_CALLS = 5
CPROFILE_CALLS = 20


@dataclass(frozen=True)
class Variant:
    call: Callable[[], object]
    capturable: bool  # nothing copied from the host inside: a CUDA graph can replay it
    result: Callable[[object], tuple] = lambda out: out  # the call's return as (o, final, checkpoint or None)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def host_us(fn: Callable[[], object], dev: torch.device, calls: int = HOST_CALLS) -> tuple[float, float]:
    """(CPU us to enqueue fn on an idle device, us until the device has finished it), medians."""
    enqueue, done = [], []
    for _ in range(calls):
        _sync(dev)
        start = time.perf_counter()
        fn()
        enqueued = time.perf_counter()
        _sync(dev)
        enqueue.append(enqueued - start)
        done.append(time.perf_counter() - start)
    return statistics.median(enqueue) * 1e6, statistics.median(done) * 1e6


def _cprofile_top(fn: Callable[[], object], dev: torch.device, top: int = 18) -> list[dict]:
    """Host time by function over CPROFILE_CALLS calls (cProfile adds its own cost per Python call, so
    compare shares, not totals): own and cumulative us per call, sorted by own time."""
    fn()
    _sync(dev)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CPROFILE_CALLS):
        fn()
    profiler.disable()
    _sync(dev)
    rows = []
    for (file, line, name), (_, ncalls, own, cumulative, _) in pstats.Stats(profiler).stats.items():
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        rows.append({"function": where, "own_us": own / CPROFILE_CALLS * 1e6,
                     "cum_us": cumulative / CPROFILE_CALLS * 1e6, "calls": ncalls / CPROFILE_CALLS})
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def _variants(T: int, H: int, dev: torch.device) -> tuple[dict[str, Variant], Callable[[str, tuple], float], dict]:
    """The timed calls by name, the error of a variant's result against the fp32 reference, and what the
    host breakdown needs (cuts, the mid-checkpoint plan, inputs)."""
    q, k, v, g, beta = kda_inputs(T, H, dev)
    h0 = torch.randn(1, H, K, V, device=dev)
    mid, end = T // 2 + 17, T - 64
    host_cu = torch.tensor([0, T])
    host_off = {cut: torch.tensor([cut]) for cut in (mid, end)}
    plans = {cut: plan_chunks([T], True, None if cut is None else [cut], CHUNK_SIZE, dev) for cut in (None, mid, end)}
    common = dict(use_qk_l2norm_in_kernel=True, gate_lower_bound=LB)

    def ours(cut: int | None, planned: bool) -> Callable[[], object]:
        off, plan = host_off.get(cut), plans[cut] if planned else None
        return lambda: chunk_kda(q, k, v, g, beta, None, h0, host_cu, off, plan=plan, **common)

    variants = {
        "ours": Variant(ours(None, False), False),
        "ours_plan": Variant(ours(None, True), True),
        f"ours+ckpt@{mid}": Variant(ours(mid, False), False),
        f"ours_plan+ckpt@{mid}": Variant(ours(mid, True), True),
        f"ours_plan+ckpt@{end}": Variant(ours(end, True), True),
    }
    dev_cu = host_cu.to(dev)
    refs = {cut: naive.chunk_kda(q, k, v, g, beta, None, h0, dev_cu, host_off[cut].to(dev), True)
            for cut in (mid, end)}
    if dev.type == "cuda":
        fla_plain, fla_split = fla_calls((q, k, v, g, beta), h0, mid)
        variants = {"fla": Variant(fla_plain, True, lambda out: (*out, None)), **variants,
                    f"fla_split@{mid}": Variant(fla_split, True, lambda out: (torch.cat(out[:2], 1), *out[2:]))}

    def error(name: str, result: tuple) -> float:
        o, final, checkpoint = result
        ref_o, ref_final, ref_cp = refs[end if name.endswith(f"@{end}") else mid]
        errs = [rel_err(ref_o, o), rel_err(ref_final, final)]
        return max(errs + ([] if checkpoint is None else [rel_err(ref_cp, checkpoint)]))

    return variants, error, {"mid": mid, "plan": plans[mid], "inputs": (q, k, v, g, beta, h0)}


def profile_heads(T: int, H: int, dev: torch.device, with_cprofile: bool) -> dict:
    variants, error, extra = _variants(T, H, dev)
    expected = "fla" if dev.type == "cuda" else "naive"
    errors = {}
    for name, variant in variants.items():
        result = variant.result(variant.call())
        if name.startswith("ours") and kda.last_backend["chunk_kda"] != expected:
            raise SystemExit(f"{name}: chunk_kda ran {kda.last_backend['chunk_kda']}, not {expected}")
        errors[name] = error(name, result)
        check(f"{name} H{H}", errors[name], TOL)
    wall = best_of_interleaved({name: v.call for name, v in variants.items()}, dev)
    rows, kernels = {}, {}
    for name, variant in variants.items():
        graph = graph_ms(variant.call, dev) if variant.capturable else None
        prof = profile_step(variant.call, dev, num_steps=PROFILED_CALLS, top=64)
        host, wall1 = host_us(variant.call, dev)
        rows[name] = dict(wall=wall[name], graph=None if graph is None else graph * 1e3,
                          busy=prof.get("kernel_busy_ms", 0) * 1e3, span=prof.get("device_span_ms", 0) * 1e3,
                          kernels=prof["events_per_step"], host=host, wall1=wall1, err=errors[name])
        kernels[name] = {k["name"]: [k["us_per_step"], k["calls_per_step"]] for k in prof.get("top_kernels", [])}
    q, k, v, g, beta, h0 = extra["inputs"]
    mid, plan = extra["mid"], extra["plan"]
    host_parts = {"plan_chunks alone (host lists -> pinned buffer -> one async copy)":
                  host_us(lambda: plan_chunks([T], True, [mid], CHUNK_SIZE, dev), dev)[0],
                  "chunk_kda, public entry, plan given (validation + fla_ops)": rows[f"ours_plan+ckpt@{mid}"]["host"]}
    if dev.type == "cuda":
        from k3serve.kernels.kda import fla_ops

        host_parts["fla_ops.chunk_kda alone (no validation)"] = host_us(
            lambda: fla_ops.chunk_kda(q, k, v, g, beta, None, h0, plan, True, CHUNK_SIZE, safe_gate=True), dev)[0]
    cprofiles = {}
    if with_cprofile:
        for name in ("fla", f"ours_plan+ckpt@{mid}"):
            if name in variants:
                cprofiles[name] = _cprofile_top(variants[name].call, dev)
    return {"T": T, "H": H, "mid": mid, "rows": rows, "kernels": kernels, "host_parts": host_parts,
            "cprofile": cprofiles}


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _delta(rows: dict, name: str, base: str, column: str) -> str:
    a, b = rows.get(name, {}).get(column), rows.get(base, {}).get(column)
    if a is None or b is None or not b:
        return "-"
    return f"{a - b:+.1f} us ({100 * (a / b - 1):+.1f}%)"


def _print_summary(case: dict) -> None:
    rows, mid, T = case["rows"], case["mid"], case["T"]
    columns = ["wall", "graph", "busy", "span", "kernels", "host", "wall1", "err"]
    print("| variant | " + " | ".join(columns) + " |\n|" + "---|" * (len(columns) + 1))
    for name, row in rows.items():
        cells = [_us(row[c]) for c in columns[:4]] + [f"{row['kernels']:.0f}", _us(row["host"]), _us(row["wall1"]),
                                                     f"{row['err']:.1e}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    ckpt, ckpt_end = f"ours_plan+ckpt@{mid}", f"ours_plan+ckpt@{T - 64}"
    print()
    for label, name, base in (("ours_plan vs fla", "ours_plan", "fla"),
                              ("ours (plan in the call) vs fla", "ours", "fla"),
                              (f"checkpoint @{mid} (plan given) vs ours_plan", ckpt, "ours_plan"),
                              (f"checkpoint @{T - 64} (plan given) vs ours_plan", ckpt_end, "ours_plan"),
                              (f"ours_plan + checkpoint @{mid} vs fla (the goal: <= +2%)", ckpt, "fla"),
                              (f"ours + checkpoint @{mid}, plan in the call, vs fla", f"ours+ckpt@{mid}", "fla")):
        deltas = "; ".join(f"{c} {_delta(rows, name, base, c)}" for c in ("wall", "graph", "busy", "host"))
        print(f"* {label}: {deltas}")
    split = rows.get(f"fla_split@{mid}")
    if split is not None:
        graph = ("" if split["graph"] is None or rows[ckpt]["graph"] is None
                 else f", graph {split['graph'] / rows[ckpt]['graph']:.2f}x")
        print(f"* fla split / ours_plan + checkpoint (the goal: >= 1.10x): wall "
              f"{split['wall'] / rows[ckpt]['wall']:.2f}x{graph}")


def _print_kernels(case: dict) -> None:
    """One row a kernel name, one column a variant: where two variants' device times part."""
    names, kernels = list(case["rows"]), case["kernels"]
    largest: dict[str, float] = {}
    for name in names:
        for kernel, (us, _) in kernels[name].items():
            largest[kernel] = max(largest.get(kernel, 0.0), us)
    print(f"\n### device time by kernel, us per call [launches] (torch.profiler, median call of {PROFILED_CALLS})\n")
    print("| kernel | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1))
    for kernel in sorted(largest, key=lambda k: -largest[k]):
        cells = ["" if kernel not in kernels[name] else "{:.1f} [{:.0f}]".format(*kernels[name][kernel])
                 for name in names]
        label = kernel if len(kernel) <= 70 else kernel[:67] + "..."
        print(f"| `{label}` | " + " | ".join(cells) + " |")


def _print_host(case: dict) -> None:
    print("\n### host time of our layers, us per call (enqueue on an idle GPU, median)\n")
    for label, us in case["host_parts"].items():
        print(f"* {label}: {us:.1f}")
    for name, top in case["cprofile"].items():
        print(f"\n### cProfile of {name}: host time by function, us per call ({CPROFILE_CALLS} calls; cProfile "
              "inflates Python-call-heavy code, compare shares)\n")
        print("| own | cumulative | calls | function |\n|---|---|---|---|")
        for r in top:
            print(f"| {r['own_us']:.1f} | {r['cum_us']:.1f} | {r['calls']:.0f} | `{r['function'][:90]}` |")


def print_case(case: dict) -> None:
    print(f"\n## T{case['T']} H{case['H']}\n")
    _print_summary(case)
    _print_kernels(case)
    _print_host(case)


def main() -> None:
    def options(parser) -> None:
        parser.add_argument("--heads", default="12,32", help="KDA head counts (12 = one K3 rank at TP8)")
        parser.add_argument("--tokens", type=int, default=8192, help="prefill length T")

    args = parse_args(__doc__, options)
    dev = device(args.smoke)
    torch.manual_seed(0)
    T = 130 if args.smoke else args.tokens
    heads = [2] if args.smoke else [int(h) for h in args.heads.split(",")]
    result = {"device": device_name(dev), "cases": []}
    versions = f"torch {torch.__version__}"
    if dev.type == "cuda":
        import fla
        import triton

        versions += f", triton {triton.__version__}, fla {fla.__version__}"
    print(f"# KDA prefill profile, {device_name(dev)} ({versions}), T={T}, heads {heads}", flush=True)
    for i, H in enumerate(heads):
        started = time.perf_counter()
        case = profile_heads(T, H, dev, with_cprofile=i == 0)
        result["cases"].append(case)
        print_case(case)
        print(f"\n(H{H}: {time.perf_counter() - started:.0f} s, compile and autotune included)", file=sys.stderr,
              flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
