"""The headline on the GPU: `k3serve serve` end to end, 8K-token prompts and 1K-token outputs at concurrency 1, 4
and 16, every optimisation against its baseline in the same run (vLLM's Kimi K3 table and ablation).

    python benchmarks/gpu_serving.py --model DIR [--layouts colocated,disagg] [--configs all_on,all_off,...]
        [--reps 3] [--concurrency 1,4,16] [--time-s 30] [--drain-s 60] [--prompt-tokens 8000]
        [--output-tokens 1000] [--transfer nixl] [--budget-s 480] [--out DIR] [--smoke]

Server: `k3serve serve --model DIR --device cuda --launcher local` (no Ray), `--mode colocated` or 1P1D
disaggregated on the same GPU (`--transfer`: nixl, mooncake or local), max_num_seqs 16, block 64, a fixed cache
(`--cache-gib` a pool), the CONFIG's engine flags (below); one server a (layout, config, repetition), started
anew, warmed up (one burst at the top concurrency of full prompts and a few tokens: graphs captured, the kernels
of those shapes compiled and tuned), then driven at each concurrency for --time-s. The plan's first server also
runs a discarded window at the top concurrency first (--first-warmup-s): the mixed prefill + decode steps of
varying size the adaptive budget makes compile their kernels there, not in a measured window; the later servers
find them in the shared Triton cache (docs/BENCHMARKS.md, fifth session: a cold first server measured 9 s TTFT).

Client (`serve_window`): `concurrency` streams, each sending a new request as soon as its last one finished, until
--time-s has passed; the requests in flight then finish (up to --drain-s, else they are cut and not counted).
Requests: token-id prompts of --prompt-tokens random ids (seed 42, no two alike: no prefix-cache hits),
--output-tokens tokens, greedy, ignore_eos, streamed (`/v1/completions`). Per completed request, as guidellm
defines them (its report's columns):
    TTFT   first streamed token - request sent
    ITL    (e2e - TTFT) / (output tokens - 1): between consecutive tokens, the first excluded
    TPOT   e2e / output tokens: per output token, the first included
    e2e    last token - request sent
median and p90 over the window's requests; output tok/s = the completed requests' tokens / (their last token -
the window's start). The handoff (disaggregated) is the server's own `k3serve:handoff_time_seconds` (mean).

CONFIGS (each an EngineArgs flag set; `all_on` is the default engine, `all_off` the anchor: every baseline switch):
    static_budget       --no-adaptive-token-budget          (adaptive token budget off)
    align_checkpoints   --kda-checkpoint-mode align         (KDA checkpoints by splitting at the boundary)
    unfused_finalize    --moe-finalize unfused              (MXFP4 experts' top-k sum after the kernels)
    no_graphs           --enforce-eager                     (no CUDA graphs)
    reference_kernels   --kernels reference                 (torch reference ops; not in all_off: an 8K prompt
                                                             takes minutes there, `all_off_reference` adds it)
Not built, so no switch: speculative decoding and its gather-based mixed batches.

Printed beside the results, from the same run: the ceilings (device copy rate, bf16 matmul rate:
`_gpu_common.ceilings`), the floors (prefill FLOPs / matmul rate; decode bytes / copy rate; the handoff bytes /
copy rate) and the TP-collectives model of the rank slice at TP 8 (`_serving_floors.py`; bus bandwidth and
latency from --allreduce-gbps / --allreduce-latency-us, stated as given: no multi-GPU collective runs here).
Every window is appended to DIR/windows.jsonl as it ends (a cut run keeps what it measured); DIR/summary.json and
the markdown tables at the end. Under --budget-s (wall seconds from the start) a server that would start later is
skipped and listed. --smoke: the CPU, k3-tiny, short prompts: checks the script, measures nothing."""

from __future__ import annotations

import argparse
import datetime
import json
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serving"))

from _gpu_common import ceilings  # noqa: E402
from _server_harness import ServerSpec, launch  # noqa: E402
from _serving_floors import (collectives_seconds, decode_step_bytes, handoff_bytes, prefill_flops,  # noqa: E402
                             step_collectives)
from k3serve.model.config import ModelConfig  # noqa: E402
from k3serve.model.presets import K3_RANK_SLICE_TP  # noqa: E402

SWITCHES = {
    "static_budget": ("--no-adaptive-token-budget",),
    "align_checkpoints": ("--kda-checkpoint-mode", "align"),
    "unfused_finalize": ("--moe-finalize", "unfused"),
    "no_graphs": ("--enforce-eager",),
}
CONFIGS: dict[str, tuple[str, ...]] = {
    "all_on": (),
    "all_off": tuple(flag for flags in SWITCHES.values() for flag in flags),
    **SWITCHES,
    "reference_kernels": ("--kernels", "reference"),
    "all_off_reference": (*(flag for flags in SWITCHES.values() for flag in flags), "--kernels", "reference"),
}
LAYOUTS = ("colocated", "disagg")
METRICS = ("ttft", "itl", "tpot", "e2e")
HANDOFF = "k3serve:handoff_time_seconds"


@dataclass
class Completion:
    ttft: float
    itl: float
    tpot: float
    e2e: float
    tokens: int
    done_at: float  # perf_counter of its last token


@dataclass
class Window:
    layout: str
    config: str
    rep: int
    concurrency: int
    time_s: float
    completed: int = 0
    cut: int = 0
    errors: list[str] = field(default_factory=list)
    out_tok_s: float | None = None
    stats_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # metric -> {"median", "p90"}
    handoff_ms: float | None = None
    server_start_s: float | None = None


# ---- client ---------------------------------------------------------------------------------------------------
class Prompts:
    """Distinct random token-id prompts (seeded), handed out one at a time across threads."""

    def __init__(self, length: int, vocab: int, seed: int = 42) -> None:
        self.length, self.vocab, self.rng, self.lock = length, vocab, random.Random(seed), threading.Lock()

    def next(self) -> list[int]:
        with self.lock:
            return [self.rng.randrange(100, self.vocab - 100) for _ in range(self.length)]


def stream_one(client: httpx.Client, url: str, model: str, prompt: list[int], max_tokens: int,
               deadline: float) -> Completion | None:
    """One streamed completion, timed at the client; None when it is still running at `deadline` (cut)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, first, last, tokens = time.perf_counter(), None, None, 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if time.perf_counter() > deadline:
                return None
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None or tokens != max_tokens:
        raise RuntimeError(f"expected {max_tokens} streamed tokens, got {tokens}")
    e2e, ttft = last - start, first - start
    return Completion(ttft, (e2e - ttft) / max(tokens - 1, 1), e2e / tokens, e2e, tokens, last)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def serve_window(url: str, model: str, prompts: Prompts, concurrency: int, max_tokens: int, time_s: float,
                 drain_s: float, window: Window) -> Window:
    """Drive `concurrency` streams for `time_s` (module doc) and fill in `window`'s numbers."""
    done: list[Completion] = []
    lock = threading.Lock()
    start = time.perf_counter()
    stop_issuing, deadline = start + time_s, start + time_s + drain_s

    def worker() -> None:
        with httpx.Client(timeout=httpx.Timeout(deadline - time.perf_counter() + 5)) as client:
            while time.perf_counter() < stop_issuing:
                try:
                    result = stream_one(client, url, model, prompts.next(), max_tokens, deadline)
                except (httpx.HTTPError, RuntimeError) as exc:
                    with lock:
                        window.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    return
                with lock:
                    if result is None:
                        window.cut += 1
                        return
                    done.append(result)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline - time.perf_counter() + 10)
    window.completed = len(done)
    if done:
        window.out_tok_s = sum(c.tokens for c in done) / (max(c.done_at for c in done) - start)
        for metric in METRICS:
            values = [getattr(c, metric) * 1e3 for c in done]
            window.stats_ms[metric] = {"median": statistics.median(values), "p90": percentile(values, 0.9)}
    return window


def histogram(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram `name` on the server's /metrics, over all its label sets."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    total = sum(float(x.split()[-1]) for x in lines if x.startswith(f"{name}_sum"))
    return total, sum(float(x.split()[-1]) for x in lines if x.startswith(f"{name}_count"))


# ---- one server -----------------------------------------------------------------------------------------------
def warm_up(url: str, model: str, prompts: Prompts, args: argparse.Namespace) -> None:
    """One burst of full prompts at the top concurrency, then one alone (--warmup-tokens each): the kernels of both
    batch shapes compiled and tuned before any window. A failure here fails the server's start."""
    deadline = time.perf_counter() + args.start_deadline_s
    for n in (max(args.concurrency), 1):
        errors: list[str] = []

        def one() -> None:
            try:
                with httpx.Client(timeout=args.start_deadline_s) as client:
                    stream_one(client, url, model, prompts.next(), args.warmup_tokens, deadline)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"{type(exc).__name__}: {exc}"[:500])

        threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.start_deadline_s)
        if errors:
            raise RuntimeError(f"warm-up of {n} requests: {errors[0]}")


def server_spec(layout: str, config: str, args: argparse.Namespace) -> ServerSpec:
    engine = ("--device", args.device, "--max-model-len", str(args.max_model_len), "--max-num-seqs",
              str(max(args.concurrency)), "--block-size", "64", "--cache-memory-bytes", str(int(args.cache_gib * 2**30)),
              "--served-model-name", "k3-serving-bench", *CONFIGS[config])
    if layout == "colocated":
        return ServerSpec(mode="colocated", launcher="local", extra_args=engine)
    return ServerSpec(mode="disaggregated", transfer=args.transfer, launcher="local", extra_args=engine)


def run_server(layout: str, config: str, rep: int, args: argparse.Namespace, vocab: int, log_dir: Path,
               record, first: bool) -> None:
    """Start the (layout, config) server, warm it up (the plan's `first` with a discarded window too), run a window
    at each concurrency, record each."""
    t0 = time.perf_counter()
    spec = server_spec(layout, config, args)
    with launch(spec, args.model, deadline_s=args.start_deadline_s,
                keep_log=log_dir / f"server-{layout}-{config}-{rep}.log") as server:
        started = time.perf_counter() - t0
        warm_up(server.url, server.model, Prompts(args.prompt_tokens, vocab, seed=1000 + rep), args)
        if first and args.first_warmup_s > 0:
            serve_window(server.url, server.model, Prompts(args.prompt_tokens, vocab, seed=2000), max(args.concurrency),
                         args.output_tokens, args.first_warmup_s, 5.0,
                         Window(layout, config, rep, max(args.concurrency), args.first_warmup_s))
        prompts = Prompts(args.prompt_tokens, vocab, seed=42 + rep)
        for c in args.concurrency:
            before = histogram(server.url, HANDOFF)
            window = serve_window(server.url, server.model, prompts, c, args.output_tokens, args.time_s,
                                  args.drain_s, Window(layout, config, rep, c, args.time_s, server_start_s=started))
            after = histogram(server.url, HANDOFF)
            count = after[1] - before[1]
            window.handoff_ms = 1e3 * (after[0] - before[0]) / count if count else None
            record(window)


# ---- report ---------------------------------------------------------------------------------------------------
def medians(windows: list[Window], layout: str, config: str, c: int) -> dict | None:
    """Across a cell's repetitions: the median of each rep's number, and the spread (min, max)."""
    cell = [w for w in windows if (w.layout, w.config, w.concurrency) == (layout, config, c) and w.completed]
    if not cell:
        return None
    out = {"reps": len(cell), "completed": sum(w.completed for w in cell), "cut": sum(w.cut for w in cell)}
    series = {"out_tok_s": [w.out_tok_s for w in cell]}
    for metric in METRICS:
        for stat in ("median", "p90"):
            series[f"{metric}_{stat}"] = [w.stats_ms[metric][stat] for w in cell]
    handoffs = [w.handoff_ms for w in cell if w.handoff_ms is not None]
    if handoffs:
        series["handoff_ms"] = handoffs
    for key, values in series.items():
        out[key] = statistics.median(values)
        out[f"{key}_spread"] = (min(values), max(values))
    return out


def fmt(value: float | None, spread: tuple[float, float] | None = None, digits: int = 1) -> str:
    if value is None:
        return "-"
    text = f"{value:.{digits}f}"
    if spread is not None and spread[0] != spread[1]:
        text += f" ({spread[0]:.{digits}f}-{spread[1]:.{digits}f})"
    return text


def report(windows: list[Window], args: argparse.Namespace, floors: dict) -> tuple[list[str], dict]:
    lines, summary = [], {"cells": {}, "floors": floors}
    cols = ["layout", "config", "conc.", "reps", "done/cut", "TTFT med ms", "TTFT p90", "ITL med ms", "ITL p90",
            "TPOT med ms", "TPOT p90", "e2e med s", "e2e p90 s", "out tok/s", "handoff ms"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for layout in args.layouts:
        for config in args.configs:
            for c in args.concurrency:
                m = medians(windows, layout, config, c)
                summary["cells"][f"{layout}/{config}/c{c}"] = m
                if m is None:
                    continue
                s = lambda k, d=1, scale=1.0: fmt(m[k] / scale, tuple(v / scale for v in m[f"{k}_spread"]), d)  # noqa: E731
                lines.append(" | ".join([
                    f"| {layout}", config, str(c), str(m["reps"]), f"{m['completed']}/{m['cut']}",
                    s("ttft_median"), s("ttft_p90"), s("itl_median", 2), s("itl_p90", 2), s("tpot_median", 2),
                    s("tpot_p90", 2), s("e2e_median", 2, 1e3), s("e2e_p90", 2, 1e3), s("out_tok_s"),
                    s("handoff_ms", 2) if "handoff_ms" in m else "-"]) + " |")
    lines += ["", "Ablation (medians over repetitions): all_on against the all_off anchor, and what each optimisation "
              "contributes (its one-off config against all_on)", ""]
    lines += ["| layout | conc. | config | out tok/s | vs all_off | vs all_on | TTFT med ms | TTFT vs all_off | "
              "TTFT vs all_on |", "|---|---|---|---|---|---|---|---|---|"]
    for layout in args.layouts:
        for c in args.concurrency:
            on, off = (summary["cells"].get(f"{layout}/{k}/c{c}") for k in ("all_on", "all_off"))
            for config in args.configs:
                m = summary["cells"].get(f"{layout}/{config}/c{c}")
                if m is None:
                    continue
                ratio = lambda ref: "-" if ref is None else f"{m['out_tok_s'] / ref['out_tok_s']:.2f}x"  # noqa: E731
                lower = lambda ref: ("-" if ref is None  # noqa: E731
                                     else f"{100 * (m['ttft_median'] / ref['ttft_median'] - 1):+.0f}%")
                lines.append(f"| {layout} | {c} | {config} | {m['out_tok_s']:.1f} | {ratio(off)} | {ratio(on)} | "
                             f"{m['ttft_median']:.1f} | {lower(off)} | {lower(on)} |")
    goals = goal_lines(summary, args, floors)
    lines += ["", *goals]
    return lines, summary


def goal_lines(summary: dict, args: argparse.Namespace, floors: dict) -> list[str]:
    """The issue's goals, each against its anchor from this run ('-' where the run lacks a cell)."""
    out = ["Goals (this run):"]
    cells = summary["cells"]
    for layout in args.layouts:
        for c in args.concurrency:
            on, off = cells.get(f"{layout}/all_on/c{c}"), cells.get(f"{layout}/all_off/c{c}")
            if on and off:
                speed = on["out_tok_s"] / off["out_tok_s"]
                ttft = 1 - on["ttft_median"] / off["ttft_median"]
                out.append(f"- {layout} c={c}: throughput {speed:.2f}x all_off (goal >= 2.8x: "
                           f"{'met' if speed >= 2.8 else 'missed'}), TTFT {100 * ttft:.0f}% lower (goal >= 85%: "
                           f"{'met' if ttft >= 0.85 else 'missed'})")
    for config in args.configs:
        for c in args.concurrency:
            col, dis = cells.get(f"colocated/{config}/c{c}"), cells.get(f"disagg/{config}/c{c}")
            if col and dis:
                r = dis["tpot_median"] / col["tpot_median"]
                out.append(f"- {config} c={c}: disaggregated TPOT {r:.3f}x colocated (goal <= 1.05: "
                           f"{'met' if r <= 1.05 else 'missed'})")
            if dis and "handoff_ms" in dis:
                eff = floors["handoff_copy_ms"] / dis["handoff_ms"]
                out.append(f"- {config} c={c}: handoff {dis['handoff_ms']:.2f} ms for {floors['handoff_mb']:.3g} MB = "
                           f"{100 * eff:.0f}% of a same-bytes device copy ({floors['handoff_copy_ms']:.3f} ms; goal >= "
                           f"70%: {'met' if eff >= 0.7 else 'missed'})")
    return out


def floor_lines(config: ModelConfig, args: argparse.Namespace, ceil: dict) -> tuple[list[str], dict]:
    """Floors and the TP-collectives model (module doc), as lines and numbers."""
    flops = prefill_flops(config, args.prompt_tokens)
    ctx = args.prompt_tokens + args.output_tokens // 2
    floors = {"prefill_tflop": flops / 1e12, "ttft_floor_ms": 1e3 * flops / ceil["bf16_flop_per_s"],
              "handoff_mb": handoff_bytes(config, args.prompt_tokens) / 1e6}
    floors["handoff_copy_ms"] = 1e3 * 2 * floors["handoff_mb"] * 1e6 / ceil["copy_bytes_per_s"]  # read + write
    lines = [f"Ceilings (this run): device copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
             f"{ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s.",
             f"Prefill floor: {floors['prefill_tflop']:.2f} TFLOP for a {args.prompt_tokens}-token prompt / matmul rate "
             f"= {floors['ttft_floor_ms']:.2f} ms TTFT.",
             f"Handoff floor: {floors['handoff_mb']:.3g} MB of an {args.prompt_tokens}-token prompt's state (MLA cache + "
             f"KDA state) as a device copy = {floors['handoff_copy_ms']:.3f} ms."]
    bus, lat = args.allreduce_gbps * 1e9, args.allreduce_latency_us * 1e-6
    tp = K3_RANK_SLICE_TP
    lines.append(f"TP{tp} collectives the single-GPU rank slice leaves out (model: {lat * 1e6:.0f} us latency + ring "
                 f"bytes / {args.allreduce_gbps:.0f} GB/s bus bandwidth, as given, not measured here):")
    prefill_coll = step_collectives(config, args.prompt_tokens, 1)
    floors["tp_prefill_ms"] = 1e3 * collectives_seconds(prefill_coll, tp, bus, lat)
    lines.append(f"- prefill of {args.prompt_tokens} tokens: {len(prefill_coll)} collectives, "
                 f"{sum(c.bytes for c in prefill_coll) / 1e6:.1f} MB a rank, +{floors['tp_prefill_ms']:.2f} ms TTFT")
    for c in args.concurrency:
        step_bytes = decode_step_bytes(config, c, ctx)
        coll = step_collectives(config, c, c)
        tp_ms = 1e3 * collectives_seconds(coll, tp, bus, lat)
        floors[f"tpot_floor_ms_c{c}"] = 1e3 * step_bytes / ceil["copy_bytes_per_s"]
        floors[f"tp_decode_ms_c{c}"] = tp_ms
        lines.append(f"- decode at batch {c} ({ctx} cached tokens): floor {step_bytes / 1e9:.2f} GB / copy rate = "
                     f"{floors[f'tpot_floor_ms_c{c}']:.3f} ms a step ({c / floors[f'tpot_floor_ms_c{c}'] * 1e3:.0f} "
                     f"tok/s); TP{tp} collectives {len(coll)} a step, {sum(x.bytes for x in coll) / 1e3:.0f} KB a "
                     f"rank, +{tp_ms:.3f} ms a step")
    return lines, floors


# ---- main -----------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (k3serve make-checkpoint --preset k3-rank-slice)")
    p.add_argument("--layouts", default="colocated", help=f"comma-separated, of {','.join(LAYOUTS)}")
    p.add_argument("--configs", default="all_on,all_off", help=f"comma-separated, of {','.join(CONFIGS)}")
    p.add_argument("--reps", type=int, default=1, help="servers a (layout, config), each started anew")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--time-s", type=float, default=30.0, help="seconds a window issues new requests")
    p.add_argument("--drain-s", type=float, default=60.0, help="then its requests in flight may finish for this long")
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--output-tokens", type=int, default=1000)
    p.add_argument("--warmup-tokens", type=int, default=8, help="output tokens of the warm-up burst's requests")
    p.add_argument("--first-warmup-s", type=float, default=20.0,
                   help="a discarded window this long at the top concurrency on the plan's first server")
    p.add_argument("--transfer", default="nixl", choices=["nixl", "mooncake", "local"])
    p.add_argument("--cache-gib", type=float, default=4.0, help="MLA blocks + KDA slots an engine (cache_memory_bytes)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget-s", type=float, default=480.0, help="start no server after this many seconds")
    p.add_argument("--start-deadline-s", type=float, default=300.0)
    p.add_argument("--allreduce-gbps", type=float, default=360.0, help="TP model: NCCL bus bandwidth, GB/s")
    p.add_argument("--allreduce-latency-us", type=float, default=12.0, help="TP model: latency a collective, us")
    p.add_argument("--out", type=Path, default=Path("gpu_serving"))
    p.add_argument("--smoke", action="store_true", help="CPU, k3-tiny, short prompts (checks the script)")
    args = p.parse_args()
    if args.smoke:
        args.device, args.prompt_tokens, args.output_tokens = "cpu", 120, 12
        args.cache_gib, args.transfer = min(args.cache_gib, 0.0625), "local" if args.transfer == "nixl" else args.transfer
    args.layouts, args.configs = args.layouts.split(","), args.configs.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    for name, chosen, known in (("layouts", args.layouts, LAYOUTS), ("configs", args.configs, CONFIGS)):
        unknown = [x for x in chosen if x not in known]
        if unknown:
            p.error(f"unknown --{name} {unknown}; choose from {list(known)}")
    if any(c < 1 for c in args.concurrency) or args.reps < 1:
        p.error("--concurrency and --reps must be positive")
    args.max_model_len = -(-(args.prompt_tokens + args.output_tokens + 64) // 64) * 64
    return args


def main() -> int:
    args = parse_args()
    if args.model is None:
        if not args.smoke:
            sys.exit("--model is required (a checkpoint directory), or --smoke")
        from k3serve.model.checkpoint import make_checkpoint

        args.model = str(make_checkpoint("k3-tiny", args.out / "k3-tiny", seed=0))
    args.out.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.from_dir(args.model)
    dev = torch.device(args.device)
    ceil = ceilings(dev, smoke=dev.type != "cuda")
    floors_text, floors = floor_lines(config, args, ceil)
    print("\n".join(floors_text), flush=True)
    plan = [(layout, cfg, rep) for rep in range(args.reps) for layout in args.layouts for cfg in args.configs]
    print(f"plan: {len(plan)} servers ({args.layouts} x {args.configs} x {args.reps} reps), windows of "
          f"{args.time_s:.0f} s (+ {args.drain_s:.0f} s drain) at concurrency {args.concurrency}, "
          f"{args.prompt_tokens} in / {args.output_tokens} out, budget {args.budget_s:.0f} s", flush=True)
    windows: list[Window] = []
    skipped: list[str] = []
    jsonl = (args.out / "windows.jsonl").open("a")

    def record(window: Window) -> None:
        windows.append(window)
        jsonl.write(json.dumps(asdict(window)) + "\n")
        jsonl.flush()
        stats = window.stats_ms
        print(f"{window.layout}/{window.config} rep {window.rep} c={window.concurrency}: {window.completed} done, "
              f"{window.cut} cut, {len(window.errors)} errors; TTFT {fmt(stats.get('ttft', {}).get('median'))} ms, "
              f"TPOT {fmt(stats.get('tpot', {}).get('median'), digits=2)} ms, {fmt(window.out_tok_s)} tok/s"
              + (f"; first error: {window.errors[0]}" if window.errors else ""), flush=True)

    def stop(signum, _frame) -> None:  # `timeout` sends SIGTERM: stop the server, keep and report what was measured
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    start = time.perf_counter()
    for i, (layout, cfg, rep) in enumerate(plan):
        if time.perf_counter() - start > args.budget_s:
            skipped.append(f"{layout}/{cfg} rep {rep}")
            continue
        try:
            run_server(layout, cfg, rep, args, config.vocab_size, args.out, record, first=i == 0)
        except KeyboardInterrupt as exc:
            skipped += [f"{layout}/{cfg} rep {rep}: stopped ({exc})"] + [f"{a}/{b} rep {c}" for a, b, c in plan[i + 1:]]
            break
        except Exception as exc:  # noqa: BLE001 - one server's failure must not lose the others' results
            skipped.append(f"{layout}/{cfg} rep {rep}: {type(exc).__name__}: {str(exc)[-2000:]}")
            print(f"FAILED {layout}/{cfg} rep {rep}: {exc}", flush=True)
    jsonl.close()
    lines, summary = report(windows, args, floors)
    header = (f"\n### Serving {Path(args.model).name} ({config.num_hidden_layers} layers) on "
              f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, {datetime.date.today()}: "
              f"{args.prompt_tokens} in / {args.output_tokens} out, windows of {args.time_s:.0f} s; medians over "
              f"repetitions (spread min-max)\n")
    print(header + "\n".join(lines) + "\n\n" + "\n".join(floors_text))
    for s in skipped:
        print(f"skipped: {s}")
    summary.update(args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, skipped=skipped,
                   ceilings=ceil)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "tables.md").write_text(header + "\n".join(lines) + "\n\n" + "\n".join(floors_text) + "\n")
    return 0 if windows else 1


if __name__ == "__main__":
    sys.exit(main())
