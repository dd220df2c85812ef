"""TTFT / TPOT / ITL / throughput of real servers on this machine: colocated vs disaggregated.

    python benchmarks/serving.py [--layouts colocated mooncake nixl] [--requests 8] [--runs 3] [--out serving.json]

Each layout is a real `k3serve serve` (Ray launcher for disaggregated, 1 prefill + 1 decode) on
the tiny model (64 MiB cache, max_model_len 1024, block 16), driven over HTTP with streaming
completions (token-id prompts, greedy, ignore_eos) and timed at the client. Scenarios:

    decode   32-token prompts, 64 output tokens, concurrency 1 and 4   -> TTFT, TPOT, ITL, tok/s
    1K       1,000-token prompts, 4 output tokens, concurrency 1       -> TTFT; the server's
             `k3serve:handoff_time_seconds` (prefill worker: writes posted -> decode acknowledged)
    engine   the same decode batches on an in-process LLMEngine (1 torch thread, no server): the
             floor under every layout's TPOT

Ingress overhead per streamed token, from the ingress's own histograms (timed where deltas
arrive from the engine or the router) against the client's clock, per scenario:
    delivery   client e2e - ingress e2e   (last token: ingress -> SSE -> client, plus parsing)
    pacing     client TPOT - ingress TPOT (per-token work the ingress adds to the stream)
Medians over the requests of a scenario (means where only a histogram's sum/count exists).
Every engine computes on one thread (OMP_NUM_THREADS=1 for the servers, as Ray actors do anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serving"))
from _server_harness import ServerSpec, launch  # noqa: E402

LAYOUTS = {
    "colocated": ServerSpec(mode="colocated", launcher="local"),
    "mooncake": ServerSpec(transfer="mooncake"),
    "nixl": ServerSpec(transfer="nixl"),
}
ENGINE_ARGS = {"block_size": 16, "max_model_len": 1024, "cache_memory_bytes": 64 << 20}
SHORT_TOKENS, DECODE_TOKENS, LONG_TOKENS, LONG_OUTPUT = 32, 64, 1000, 4
INGRESS = {"e2e": "vllm:e2e_request_latency_seconds", "tpot": "vllm:request_time_per_output_token_seconds",
           "ttft": "vllm:time_to_first_token_seconds", "handoff": "k3serve:handoff_time_seconds",
           "prefill": "vllm:request_prefill_time_seconds"}


def prompts(num: int, length: int, salt: int) -> list[list[int]]:
    """Distinct token-id prompts (no shared prefix: no prefix-cache hits between them)."""
    return [[(salt * 131 + i * 17 + j * 7) % 450 + 20 for j in range(length)] for i in range(num)]


# ---- client side ------------------------------------------------------------------------------
def stream_one(client: httpx.Client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, num_tokens = [], 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                stamps.append(time.perf_counter())
            elif chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    if num_tokens != max_tokens or len(stamps) < 2:
        raise RuntimeError(f"expected {max_tokens} tokens, got {num_tokens} in {len(stamps)} chunks")
    # a chunk is one token here (the tiny tokenizer's partial UTF-8 may merge a few: counted by usage)
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tpot": (stamps[-1] - stamps[0]) / (num_tokens - 1), "e2e": stamps[-1] - t0, "tokens": num_tokens}


def histograms(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the ingress histograms in INGRESS."""
    out = {}
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    for key, name in INGRESS.items():
        total = next((float(x.split()[-1]) for x in lines if x.startswith(f"{name}_sum")), 0.0)
        count = next((float(x.split()[-1]) for x in lines if x.startswith(f"{name}_count")), 0.0)
        out[key] = (total, count)
    return out


def scenario(url: str, model: str, batch: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    before = histograms(url)
    # one pooled client, made before the clock starts (a new httpx client costs ~25 ms: SSL context)
    with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:
        client.get(f"{url}/v1/models")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda p: stream_one(client, url, model, p, max_tokens), batch))
        wall = time.perf_counter() - t0
    after = histograms(url)
    ingress = {}
    for key in INGRESS:
        dsum, dcount = after[key][0] - before[key][0], after[key][1] - before[key][1]
        ingress[key] = 1e3 * dsum / dcount if dcount else None
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {
        "ttft_ms": ms([r["ttft"] for r in results]),
        "tpot_ms": ms([r["tpot"] for r in results]),
        "itl_ms": ms([x for r in results for x in r["itl"]]),
        "e2e_mean_ms": 1e3 * statistics.mean(r["e2e"] for r in results),
        "tpot_mean_ms": 1e3 * statistics.mean(r["tpot"] for r in results),
        "out_tok_s": sum(r["tokens"] for r in results) / wall,
        "ingress_mean_ms": ingress,
    }


def bench_layout(spec: ServerSpec, model_dir: Path, num_requests: int) -> dict:
    with launch(spec, model_dir) as server:
        url, model = server.url, server.model
        scenario(url, model, prompts(4, SHORT_TOKENS, 99), 8, 2)  # warm-up: handshakes, first steps
        short = prompts(num_requests, SHORT_TOKENS, 1)
        row = {f"c{c}": scenario(url, model, short, DECODE_TOKENS, c) for c in (1, 4)}
        row["long"] = scenario(url, model, prompts(max(3, num_requests // 2), LONG_TOKENS, 2), LONG_OUTPUT, 1)
    return row


# ---- engine floor -----------------------------------------------------------------------------
def engine_tpot_ms(model_dir: Path, batch_size: int, repeats: int = 3) -> float:
    """Median decode step time of `batch_size` requests on an in-process engine (1 torch thread,
    as in a Ray actor): time between consecutive steps once every request is decoding."""
    import torch

    from k3serve.engine.config import EngineArgs
    from k3serve.engine.llm_engine import LLMEngine
    from k3serve.engine.sampling_params import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine(EngineArgs(model=str(model_dir), **ENGINE_ARGS))
        params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
        steps = []
        for r in range(repeats):
            for i, p in enumerate(prompts(batch_size, SHORT_TOKENS, 7 + r)):
                engine.add_request(p, params, f"r{r}-{i}")
            engine.step()  # the prompts (one step: short prompts, one budget)
            last = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
                now = time.perf_counter()
                steps.append(now - last)
                last = now
        engine.close()
        return 1e3 * statistics.median(steps)
    finally:
        torch.set_num_threads(threads)


def median_of_runs(runs: list):
    """Cell-wise median of equally shaped nested dicts of numbers (None stays None)."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of_runs([r[k] for r in runs]) for k in first}
    if first is None or isinstance(first, str):
        return first
    return statistics.median(runs)


# ---- report -----------------------------------------------------------------------------------
def report(rows: dict[str, dict], engine: dict[int, float]) -> list[str]:
    out = ["| layout | c=1 TTFT ms | c=1 TPOT ms | c=1 ITL ms | c=4 TTFT ms | c=4 TPOT ms | c=4 ITL ms | "
           "c=4 out tok/s | 1K-prompt TTFT ms | handoff ms (server) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        handoff = r["long"]["ingress_mean_ms"]["handoff"]
        out.append(f"| {name} | {r['c1']['ttft_ms']:.1f} | {r['c1']['tpot_ms']:.2f} | {r['c1']['itl_ms']:.2f} | "
                   f"{r['c4']['ttft_ms']:.1f} | {r['c4']['tpot_ms']:.2f} | {r['c4']['itl_ms']:.2f} | "
                   f"{r['c4']['out_tok_s']:.0f} | {r['long']['ttft_ms']:.1f} | "
                   f"{'-' if not handoff else f'{handoff:.2f}'} |")
    out.append(f"| engine, in-process, 1 thread (no server) | | {engine[1]:.2f} | | | {engine[4]:.2f} | | | | |")
    out.append("")
    base = rows.get("colocated")
    for name, r in rows.items():
        ing1 = r["c1"]["ingress_mean_ms"]
        delivery = r["c1"]["e2e_mean_ms"] - ing1["e2e"]
        pacing = r["c1"]["tpot_mean_ms"] - ing1["tpot"]
        line = (f"- {name}: ingress overhead per token at c=1: delivery {delivery:+.2f} ms, pacing {pacing:+.3f} ms "
                f"(target < 2 ms); TPOT over the engine floor: c=1 {r['c1']['tpot_ms'] - engine[1]:+.2f} ms, "
                f"c=4 {r['c4']['tpot_ms'] - engine[4]:+.2f} ms")
        if base is not None and r is not base:
            line += (f"; TPOT / colocated at c=4: {r['c4']['tpot_ms'] / base['c4']['tpot_ms']:.2f} (target <= 1.2); "
                     f"1K-prompt TTFT - colocated: {r['long']['ttft_ms'] - base['long']['ttft_ms']:+.1f} ms; "
                     f"handoff (server): {r['long']['ingress_mean_ms']['handoff']:.2f} ms (target < 20)")
        out.append(line)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--requests", type=int, default=8, help="requests per decode scenario")
    parser.add_argument("--runs", type=int, default=1, help="repeat everything; report cell-wise medians of the runs")
    parser.add_argument("--out", help="write every number as JSON here")
    args = parser.parse_args()
    # One compute thread per engine everywhere: Ray actors set it themselves; the colocated server
    # would otherwise run torch on every core, next to its own ingress, on a 2-core host.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from k3serve.model.checkpoint import make_checkpoint
    from k3serve.progress import stage

    with tempfile.TemporaryDirectory() as d:
        model_dir = make_checkpoint("k3-tiny", Path(d) / "tiny", seed=0)
        engine_runs, row_runs = [], []
        for run in range(1, args.runs + 1):
            with stage(f"run {run}/{args.runs}: the engine's decode step, batch 1 and 4"):
                engine_runs.append({b: engine_tpot_ms(model_dir, b) for b in (1, 4)})
            layouts = {}
            for i, name in enumerate(args.layouts, 1):
                with stage(f"run {run}/{args.runs}: layout {i}/{len(args.layouts)} {name} (start a server, 4 scenarios)"):
                    layouts[name] = bench_layout(LAYOUTS[name], model_dir, args.requests)
            row_runs.append(layouts)
    engine, rows = median_of_runs(engine_runs), median_of_runs(row_runs)
    print(f"k3-tiny on CPU, streaming completions, greedy, ignore_eos; client-side medians "
          f"(median of {args.runs} run(s))")
    print("\n".join(report(rows, engine)))
    if args.out:
        Path(args.out).write_text(json.dumps({"layouts": rows, "engine_tpot_ms": engine, "runs": row_runs,
                                              "engine_runs": engine_runs}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
