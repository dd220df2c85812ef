"""Per-step cost of `Sampler.sample` for a decode batch whose requests carry a logit_bias.

    python benchmarks/sampler_logit_bias.py [--rows 32] [--bias-entries 50] [--vocab 512 163840]
        [--steps 300] [--device cpu] [--out results.json]

For each vocabulary size, `rows` greedy requests (the sampler's cheapest path, so the bias is what shows),
timed over `steps` calls of the real `Sampler` as the engine makes them, one a decode step (the three modes
take turns step by step, each with its own Sampler):

    no bias   no request has a logit_bias (what every batch without one pays)
    steady    every request has `bias-entries` biased tokens; the same requests every step
    churn     as steady, but one request leaves and a new one joins before every step (the batch
              composition changes every step: the worst case for per-batch state)

Prints the median microseconds of a step and the bias's share (steady or churn minus no bias).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from k3serve.engine.sampler import Sampler
from k3serve.engine.sampling_params import SamplingParams


def biased_params(gen: torch.Generator, vocab: int, num_entries: int) -> SamplingParams:
    token_ids = torch.randperm(vocab, generator=gen)[:num_entries].tolist()
    values = (torch.rand(num_entries, generator=gen) * 20 - 10).tolist()
    return SamplingParams(temperature=0.0, logit_bias=dict(zip(token_ids, values)))


def time_steps(logits: torch.Tensor, batches: dict[str, Callable[[int], list[SamplingParams]]],
               steps: int) -> dict[str, float]:
    """Median seconds of one `sample` call per mode; `batches[mode](step)` is that mode's params at `step`. Each
    mode has its own Sampler (as an engine has), and the modes take turns step by step, so a change in the
    machine's load reaches all of them alike."""
    rows = logits.shape[0]
    empty, generators = [[] for _ in range(rows)], [None] * rows
    samplers = {mode: Sampler() for mode in batches}
    times: dict[str, list[float]] = {mode: [] for mode in batches}
    for step in range(steps):
        for mode, next_params in batches.items():
            params = next_params(step)
            if logits.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            samplers[mode].sample(logits, params, empty, empty, generators)  # ends copying the tokens to the host
            times[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(t[steps // 10 :]) for mode, t in times.items()}  # the first tenth warms up


def measure(vocab: int, rows: int, num_entries: int, steps: int, device: str) -> dict[str, float]:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(device)
    plain = [SamplingParams(temperature=0.0) for _ in range(rows)]
    steady = [biased_params(gen, vocab, num_entries) for _ in range(rows)]
    churning = list(steady)
    joining = [biased_params(gen, vocab, num_entries) for _ in range(steps)]

    def churn(step: int) -> list[SamplingParams]:
        churning[step % rows] = joining[step]  # a request leaves, a new one joins in its row
        return churning

    seconds = time_steps(logits, {"no_bias": lambda step: plain, "steady": lambda step: steady, "churn": churn}, steps)
    result = {f"{mode}_us": s * 1e6 for mode, s in seconds.items()}
    result["steady_bias_share_us"] = result["steady_us"] - result["no_bias_us"]
    result["churn_bias_share_us"] = result["churn_us"] - result["no_bias_us"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--bias-entries", type=int, default=50)
    parser.add_argument("--vocab", type=int, nargs="+", default=[512, 163840])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if min(args.rows, args.bias_entries, args.steps, *args.vocab) < 1 or args.bias_entries > min(args.vocab):
        parser.error("--rows, --bias-entries, --steps, --vocab must be >= 1 and --bias-entries <= every --vocab")

    print(f"{args.rows} greedy rows, {args.bias_entries} biased tokens each, {args.device}, "
          f"{torch.get_num_threads()} threads, median of {args.steps} steps (us per step)")
    print("| vocab  | no bias | steady | churn | steady - no bias | churn - no bias |")
    print("|--------|---------|--------|-------|------------------|-----------------|")
    results = {}
    for vocab in args.vocab:
        r = measure(vocab, args.rows, args.bias_entries, args.steps, args.device)
        results[vocab] = r
        print(f"| {vocab:<6} | {r['no_bias_us']:>7.0f} | {r['steady_us']:>6.0f} | {r['churn_us']:>5.0f} | "
              f"{r['steady_bias_share_us']:>16.0f} | {r['churn_bias_share_us']:>15.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "out"}, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
