"""The MoE GEMV pair, issue 7: the kernels before and after the rewrite and the new kernels' tile configs side
by side, in ONE GPU run; after it the winning configs stay in kernels/moe/triton_gemv.py and this file and
_moe_gemv_head.py are deleted.

    source benchmarks/_gpu_env.sh && python3 benchmarks/moe_gemv_variants.py --out $OUT/moe_variants.json
    python benchmarks/moe_gemv_variants.py --smoke     # CPU, Triton's interpreter, tiny shapes: the script only

K3 per-rank shapes (D 3584, I 3072, 112 local experts, top-16 of 896), T = 1, 2, 4, 8, 16 tokens, fresh random
inputs per T (at least one pair on this rank). Times are CUDA-graph replays (median us):
  head   the pair before the rewrite (_moe_gemv_head.py): memset + routing + up + down, autotuned
  new    triton_moe.fused_experts on the new kernels (inline PTX; routing + up + down, the up kernel zeroes out)
  plain  the same with PTX off (plain Triton decode and loads, what the interpreter runs), autotuned afresh
  route  the routing kernel alone (in head and new alike)
  pair_tuned  up + down alone, both autotuned; pair_best  the same with the best config of each kernel (measured
         one kernel at a time against the other's autotuned one: the sum of the two gains); best_up / best_down
         name them, tuned the autotuned ones (BLOCK_N/ROWS/warps/PREFETCH[/SPLIT_K])
Each phase runs in a process of its own (a kernel fault cannot take the others down); every variant and config
is checked against the fp32 reference (naive.py) before it is timed, and a failure is listed, not timed.
floor = MXFP4 bytes of the experts hit (+ x and out) / the copy bandwidth measured here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

from _gpu_common import ceilings, graph_ms, print_table, rel_err
from gpu_moe import SITU, random_mxfp4

K3 = {"E": 112, "I": 3072, "D": 3584, "TOP_K": 16, "TOTAL": 896, "TOKENS": (1, 2, 4, 8, 16)}
SMOKE = {"E": 4, "I": 128, "D": 256, "TOP_K": 4, "TOTAL": 8, "TOKENS": (1, 3)}
TOL = 1e-4  # fp32 math on exactly decoded weights: ~3e-7 against the fp32 reference
PHASES = ("head", "new", "plain")
EXTRA_UP = [(4, 1, 2, 1, 14), (16, 1, 2, 1, 4)]  # BLOCK_N, ROWS, warps, PREFETCH, programs per SM (they fit)
EXTRA_DOWN = [(4, 1, 1, 1, 2, 21), (8, 1, 1, 1, 2, 12), (8, 1, 2, 1, 1, 12)]  # ..., PREFETCH, SPLIT_K, programs


def bank(s: dict, dev):
    from k3serve.kernels.moe import ExpertWeights

    torch.manual_seed(0)
    return ExpertWeights(*(random_mxfp4(s["E"], *shape, dev=dev) for shape in
                           ((s["I"], s["D"]), (s["I"], s["D"]), (s["D"], s["I"]))))


def inputs(s: dict, T: int, dev):
    """x, topk_weights, topk_ids for T tokens, seeded by T (the same in every phase)."""
    gen = torch.Generator(device=dev).manual_seed(1000 + T)
    x = torch.randn(T, s["D"], device=dev, dtype=torch.bfloat16, generator=gen)
    while True:
        ids = torch.stack([torch.randperm(s["TOTAL"], device=dev, generator=gen)[:s["TOP_K"]] for _ in range(T)])
        if (ids < s["E"]).any():
            return x, torch.rand(T, s["TOP_K"], device=dev, generator=gen), ids


def checked_us(name: str, fn, ref, dev) -> dict:
    """{us, err} of fn under a CUDA graph (us None off CUDA), or {error} if it raises or misses the reference."""
    try:
        err = rel_err(ref, fn())
        if not err <= TOL:
            return {"error": f"{name}: relative error {err:.2e} > {TOL:.0e}, not timed"}
        ms = graph_ms(fn, dev)
        return {"us": None if ms is None else ms * 1e3, "err": err}
    except Exception as exc:  # noqa: BLE001 - one candidate failing must not stop the others
        return {"error": f"{name}: {type(exc).__name__}: {str(exc)[:300]}"}


def label(config: triton.Config) -> str:
    k = config.kwargs
    parts = (k["BLOCK_N"], k["ROWS"], config.num_warps, k["PREFETCH"]) + ((k["SPLIT_K"],) if "SPLIT_K" in k else ())
    return "/".join(map(str, parts))


def extra_configs(shapes, split: bool) -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": s[0], "BLOCK_K": 512, "ROWS": s[1], "PREFETCH": s[3], "PROGRAMS_PER_SM": s[-1],
                           **({"SPLIT_K": s[4]} if split else {})}, num_warps=s[2], num_stages=1) for s in shapes]


def sweep(kernel, candidates, run, ref, dev) -> dict:
    """{config label: checked_us of `run` (up and down) with `kernel` on that config alone}; the other kernel
    keeps its autotuned config."""
    saved = kernel.configs
    times = {}
    try:
        for config in candidates:
            kernel.configs = [config]  # one config: the autotuner launches it without benchmarking
            kernel.cache.clear()
            times[label(config)] = checked_us(label(config), run, ref, dev)
    finally:
        kernel.configs = saved
        kernel.cache.clear()
    return times


def phase(name: str, s: dict, smoke: bool, out: Path) -> None:
    """One phase's rows (per T) as JSON at out."""
    import _moe_gemv_head as head
    from k3serve.kernels.moe import naive, triton_gemv, triton_moe

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels = {"up": triton_gemv.gemv_up_kernel, "down": triton_gemv.gemv_down_kernel}
    candidates = {"up": triton_gemv.configs_up() + extra_configs(EXTRA_UP, False),
                  "down": triton_gemv.configs_down() + extra_configs(EXTRA_DOWN, True)}
    if smoke:  # the interpreter cannot benchmark: one config each
        for kernel in (*kernels.values(), head.gemv_up_kernel, head.gemv_down_kernel):
            kernel.configs = kernel.configs[:1]
        candidates = {k: v[:2] for k, v in candidates.items()}
    if name == "plain":
        triton_gemv.PTX = False
    weights = bank(s, dev)
    rows = {}
    for T in s["TOKENS"]:
        x, tw, ids = inputs(s, T, dev)
        ref = naive.fused_experts(x, weights, tw, ids, SITU, 0)
        if name == "head":
            run_head = lambda: head.fused_experts(x, weights, tw, ids, (1, 4.0, 25.0))  # noqa: E731
            row = {"head": checked_us("head", run_head, ref, dev),
                   "route": {"us": (graph_ms(lambda: triton_moe.route_small(ids, 0, s["E"]), dev) or 0) * 1e3}}
        else:
            run = lambda: triton_moe.fused_experts(x, weights, tw, ids, SITU, 0, path="gemv")  # noqa: E731
            row = {name: checked_us(name, run, ref, dev)}
            row["tuned"] = {k: label(next(reversed(kernel.cache.values()))) for k, kernel in kernels.items()
                            if kernel.cache}
            if name == "new":
                for k, kernel in kernels.items():
                    row[k] = sweep(kernel, candidates[k], run, ref, dev)
        rows[T] = row
        print(f"{name} T{T}: {json.dumps(row)[:600]}", flush=True)
    out.write_text(json.dumps(rows))


def best(times: dict) -> tuple[str, float | None]:
    ok = {k: v["us"] for k, v in times.items() if v.get("us") is not None}
    return (min(ok, key=ok.get), ok[min(ok, key=ok.get)]) if ok else ("-", None)


def row_of(s: dict, T: int, r: dict, ceil: dict, dev) -> tuple[dict, list[str]]:
    """The table row of T from the phases' results, and their errors."""
    _, _, ids = inputs(s, T, dev)
    experts = int(torch.unique(ids[ids < s["E"]]).numel())
    moved = experts * 3 * s["I"] * s["D"] * (0.5 + 1 / 32) + T * s["D"] * (2 + 4)
    floor = moved / ceil["copy_bytes_per_s"] * 1e6
    us = {k: r.get(k, {}).get("us") for k in ("head", "new", "plain", "route")}
    tuned = r.get("tuned", {})
    up_cfg, up_us = best(r.get("up", {}))
    down_cfg, down_us = best(r.get("down", {}))
    pair_tuned = r.get("up", {}).get(tuned.get("up"), {}).get("us")
    pair_best = None if None in (pair_tuned, up_us, down_us) else up_us + down_us - pair_tuned
    errors = [r[k]["error"] for k in ("head", "new", "plain") if "error" in r.get(k, {})]
    errors += [v["error"] for k in ("up", "down") for v in r.get(k, {}).values() if "error" in v]
    new = us["new"]
    return dict(T=T, experts=experts, floor=floor, head="FAIL" if "error" in r.get("head", {}) else us["head"],
                new="FAIL" if "error" in r.get("new", {}) else new,
                plain="FAIL" if "error" in r.get("plain", {}) else us["plain"], route=us["route"],
                pair_tuned=pair_tuned, pair_best=pair_best, best_up=up_cfg, best_down=down_cfg,
                tuned=f"{tuned.get('up', '-')} {tuned.get('down', '-')}",
                new_x_floor="-" if new is None else f"{new / floor:.2f}",
                new_TBps="-" if new is None else f"{moved / new / 1e6:.2f}",
                head_over_new="-" if new is None or us["head"] is None else f"{us['head'] / new:.2f}"), errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the rows, sweeps and errors as JSON here")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, Triton's interpreter off CUDA: checks the script only")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # a child process's one phase
    parser.add_argument("--phase-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    s = SMOKE if args.smoke else K3
    if args.phase:
        if triton.knobs.runtime.interpret:  # the tests' fix for range() over loaded scalars under numpy >= 2.4
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            import _triton_interpret

            _triton_interpret._fix_scalar_index()
        return phase(args.phase, s, args.smoke, args.phase_out)
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("needs a CUDA device (or --smoke)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = dict(os.environ, **({} if dev.type == "cuda" else {"TRITON_INTERPRET": "1"}))
    ceil = ceilings(dev, args.smoke)
    results, errors = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name in PHASES:
            path = Path(tmp) / f"{name}.json"
            start = time.time()
            command = [sys.executable, __file__, "--phase", name, "--phase-out", str(path)] + ["--smoke"] * args.smoke
            returncode = subprocess.run(command, env=env, timeout=150 if dev.type == "cuda" else 900).returncode
            print(f"== phase {name}: rc {returncode}, {time.time() - start:.0f} s", flush=True)
            if returncode or not path.exists():
                errors.append(f"phase {name} exited with {returncode}")
                continue
            for T, row in json.loads(path.read_text()).items():
                results.setdefault(int(T), {}).update(row)
    rows = []
    for T in s["TOKENS"]:
        row, row_errors = row_of(s, T, results.get(T, {}), ceil, dev)
        rows.append(row)
        errors += row_errors
    columns = ["T", "experts", "floor", "head", "new", "plain", "route", "pair_tuned", "pair_best", "best_up",
               "best_down", "tuned", "new_x_floor", "new_TBps", "head_over_new"]
    print_table(f"MoE GEMV pair variants (us, CUDA graphs; D {s['D']}, I {s['I']}, {s['E']} local of {s['TOTAL']} "
                f"experts, top-{s['TOP_K']})", columns, rows, ceil, dev)
    for error in errors:
        print("ERROR", error)
    if args.out is not None:
        args.out.write_text(json.dumps({"ceilings": ceil, "rows": rows, "errors": errors,
                                        "phases": {str(k): v for k, v in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
