"""TTFT / TPOT / ITL / throughput of real servers on this machine: colocated vs disaggregated.

    python benchmarks/serving.py [--layouts colocated mooncake nixl] [--out serving.json]

Each layout is a real `k3serve serve` (Ray launcher for disaggregated) on the tiny model, driven
over HTTP with streaming completions (greedy, ignore_eos), measured at the client:
  * decode: short prompts (32 tokens), 64 output tokens, concurrency 1 and 4 -> TTFT, TPOT, ITL
  * handoff: 1,000-token prompts, 4 output tokens, concurrency 1 -> TTFT; the server's own
    `k3serve:handoff_time_seconds` (prefill worker: writes posted -> decode acknowledged)
  * ingress overhead per token: client-observed ITL minus the ingress's own
    `k3serve:inter_token_latency_seconds` (measured where deltas arrive from the engine)
The colocated server is the anchor in the same run. Medians over all requests of a scenario.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serving"))
from _server_harness import ServerSpec, launch  # noqa: E402

from k3serve.model.checkpoint import make_checkpoint  # noqa: E402

LAYOUTS = {
    "colocated": ServerSpec(mode="colocated", launcher="local"),
    "mooncake": ServerSpec(transfer="mooncake"),
    "nixl": ServerSpec(transfer="nixl"),
}


def stream_one(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {resp.read().decode()[:300]}")
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    tpot = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "e2e": stamps[-1] - t0, "chunks": len(stamps)}


def run(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: stream_one(url, model, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    return {
        "ttft_ms": 1e3 * statistics.median(r["ttft"] for r in results),
        "tpot_ms": 1e3 * statistics.median(r["tpot"] for r in results),
        "itl_ms": 1e3 * statistics.median(x for r in results for x in r["itl"]),
        "out_tok_s": sum(r["chunks"] for r in results) / wall,
    }


def metric_mean(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram from /metrics."""
    total = count = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}_sum"):
            total = float(line.split()[-1])
        elif line.startswith(f"{name}_count"):
            count = float(line.split()[-1])
    return total, count


def bench_layout(name: str, spec: ServerSpec, model_dir: Path, requests: int) -> dict:
    short = [[(7 * i + j) % 400 + 20 for j in range(32)] for i in range(requests)]
    long = [[(13 * i + j) % 400 + 20 for j in range(1000)] for i in range(5)]
    with launch(spec, model_dir) as server:
        url, model = server.url, server.model
        run(url, model, short[:2], 8, 1)  # warm-up
        row = {"layout": name}
        for c in (1, 4):
            row[f"c{c}"] = run(url, model, short, 64, c)
        itl_sum0, itl_n0 = metric_mean(url, "k3serve:inter_token_latency_seconds")
        h_sum0, h_n0 = metric_mean(url, "k3serve:handoff_time_seconds")
        row["long"] = run(url, model, long, 4, 1)
        h_sum, h_n = metric_mean(url, "k3serve:handoff_time_seconds")
        row["handoff_ms"] = 1e3 * (h_sum - h_sum0) / (h_n - h_n0) if h_n > h_n0 else 0.0
        itl_sum, itl_n = metric_mean(url, "k3serve:inter_token_latency_seconds")
        row["ingress_itl_ms"] = 1e3 * itl_sum / itl_n if itl_n else float("nan")
        row["client_itl_mean_ms"] = row["c1"]["itl_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model_dir = make_checkpoint("k3-tiny", Path(d) / "tiny", seed=0)
        rows = [bench_layout(name, LAYOUTS[name], model_dir, args.requests) for name in args.layouts]
    print("k3-tiny on CPU (reference kernels), streaming completions, greedy; medians")
    print("| layout | c=1 TTFT ms | c=1 TPOT ms | c=4 TTFT ms | c=4 TPOT ms | c=4 out tok/s | 1K-prompt TTFT ms | handoff ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['c1']['ttft_ms']:.1f} | {r['c1']['tpot_ms']:.1f} | {r['c4']['ttft_ms']:.1f} | "
              f"{r['c4']['tpot_ms']:.1f} | {r['c4']['out_tok_s']:.1f} | {r['long']['ttft_ms']:.1f} | {r['handoff_ms']:.2f} |")
    base = next((r for r in rows if r["layout"] == "colocated"), None)
    for r in rows:
        if base is None or r is base:
            continue
        print(f"{r['layout']}: TPOT ratio at c=4 {r['c4']['tpot_ms'] / base['c4']['tpot_ms']:.2f} (target <= 1.2); "
              f"1K-prompt TTFT - colocated {r['long']['ttft_ms'] - base['long']['ttft_ms']:+.1f} ms, "
              f"handoff {r['handoff_ms']:.2f} ms (target < 20); ingress per-token overhead "
              f"{r['c1']['itl_ms'] - r['ingress_itl_ms']:+.2f} ms (client ITL median - ingress ITL mean; target < 2)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
