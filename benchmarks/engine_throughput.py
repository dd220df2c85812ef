"""Offline throughput of LLMEngine against two naive ways of running the same model.

    python benchmarks/engine_throughput.py [--model k3-tiny] [--num-prompts 32] [--prompt-len 256]
        [--output-len 32] [--runs 3] [--baseline-prompts 4] [--prompt-logprobs N] [--out results.json]

Three ways to generate `output-len` greedy tokens (ignore_eos) for random prompts:

    engine       LLMEngine: all prompts at once, continuous batching, paged MLA + KDA slots
    incremental  one request at a time, the model with its own cache: one prefill pass, then
                 one forward per token (no batching, no scheduler)
    naive        one request at a time, no cache: every token is one full pass over the
                 whole sequence so far (model/score.py, the correctness oracle)

With --prompt-logprobs N, a second table: the same prompts run to their first token (max_tokens=1) by the
engine, without and with `prompt_logprobs=N` (every prompt position scored: its logprob, rank and the top N),
in prompt tokens/s; every position but the first must come back scored.

The baselines run on the first `baseline-prompts` prompts only (the naive loop is quadratic);
tokens/s is per second of wall time either way, so the rows compare. Each figure is the median
of `runs` runs, each on fresh prompts (so the engine's prefix cache never hits). The engine is
built once and warmed up; building it is not timed. The greedy tokens of every baseline prompt
must agree across the three ways ("tokens match" column). Prints one table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from k3serve.engine.config import DEFAULT_MODEL_CACHE_DIR, EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.model.packaged import resolve_model_dir
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.batch import ForwardBatch, ModelCache
from k3serve.model.model import KimiForCausalLM
from k3serve.model.score import score_tokens

BLOCK_SIZE = 64


@dataclass
class Row:
    method: str
    num_requests: int  # per run
    num_prompt_tokens: int  # per run
    num_output_tokens: int  # per run
    median_s: float  # wall time of one run
    output_tokens_per_s: float
    total_tokens_per_s: float  # (prompt + output) / wall time
    speedup_vs_naive: float  # output tokens/s over the naive loop's
    tokens_match: bool  # greedy tokens equal the engine's on the baseline prompts


def engine_generate(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
    return [tokens[i] for i in ids]


@dataclass
class PrefillRow:
    prompt_logprobs: int | None  # the requests' prompt_logprobs; None: not asked
    num_prompt_tokens: int  # per run
    median_s: float  # wall time of one run
    prompt_tokens_per_s: float
    all_scored: bool  # every run scored every prompt position but the first (none when not asked)


def engine_prefill(engine: LLMEngine, prompts: list[list[int]], prompt_logprobs: int | None) -> int:
    """Every prompt to its first token; returns how many prompt positions came back scored."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    for p in prompts:
        engine.add_request(p, params)
    num_scored = 0
    while engine.has_unfinished():
        for delta in engine.step():
            num_scored += sum(entry is not None for entry in delta.prompt_logprobs or ())
    return num_scored


def measure_prompt_logprobs(engine: LLMEngine, args: argparse.Namespace, vocab: int) -> list[PrefillRow]:
    """Prefill tokens/s without and with prompt logprobs, on fresh prompts each run (no prefix-cache hit: a hit's
    positions are not scored); the two take turns run by run, so a change in the machine's load meets both."""
    times: dict[int | None, list[float]] = {None: [], args.prompt_logprobs: []}
    all_scored = dict.fromkeys(times, True)
    for run in range(args.runs):
        for num_top in times:
            gen = torch.Generator().manual_seed(2000 + 2 * run + (num_top is not None))
            prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
            seconds, num_scored = timed(lambda: engine_prefill(engine, prompts, num_top))
            times[num_top].append(seconds)
            all_scored[num_top] &= num_scored == (0 if num_top is None else args.num_prompts * (args.prompt_len - 1))
            print(f"run {run + 1}/{args.runs}: prefill, prompt_logprobs={num_top}: {seconds:.2f}s", file=sys.stderr)
    num_prompt = args.num_prompts * args.prompt_len
    return [PrefillRow(num_top, num_prompt, statistics.median(t), num_prompt / statistics.median(t), all_scored[num_top])
            for num_top, t in times.items()]


def incremental_generate(model: KimiForCausalLM, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """One request at a time: prefill in one pass, then decode token by token from the cache."""
    device = next(model.parameters()).device
    outputs = []
    for prompt in prompts:
        num_blocks = math.ceil((len(prompt) + output_len) / BLOCK_SIZE)
        blocks = list(range(num_blocks))
        cache = ModelCache.allocate(model.config, num_blocks, 1, BLOCK_SIZE, 1, model.dtype, device)
        batch = ForwardBatch.build([prompt], [0], [blocks], [0], BLOCK_SIZE, device=device)
        token = int(model.compute_logits(model(batch, cache)[-1:])[0].argmax())
        out = [token]
        while len(out) < output_len:
            batch = ForwardBatch.build([[token]], [len(prompt) + len(out) - 1], [blocks], [0], BLOCK_SIZE, device=device)
            token = int(model.compute_logits(model(batch, cache))[0].argmax())
            out.append(token)
        outputs.append(out)
    return outputs


def naive_generate(model: KimiForCausalLM, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """One request at a time, no cache: each token is a full pass over the sequence so far."""
    outputs = []
    for prompt in prompts:
        out: list[int] = []
        while len(out) < output_len:
            out.append(int(score_tokens(model, prompt + out)[-1].argmax()))
        outputs.append(out)
    return outputs


def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="k3-tiny", help="checkpoint directory or small preset")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline-prompts", type=int, default=4, help="prompts the two naive baselines run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-logprobs", type=int, metavar="N",
                        help="also measure prefill tokens/s with prompt_logprobs=N against without")
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args(argv)
    if min(args.num_prompts, args.prompt_len, args.output_len, args.runs, args.baseline_prompts) < 1:
        parser.error("--num-prompts, --prompt-len, --output-len, --runs and --baseline-prompts must be >= 1")
    if args.prompt_logprobs is not None and (args.prompt_logprobs < 0 or args.prompt_len < 2):
        parser.error("--prompt-logprobs must be >= 0, and scoring a prompt needs --prompt-len >= 2")

    model_dir = resolve_model_dir(args.model, args.seed, str(DEFAULT_MODEL_CACHE_DIR))
    engine = LLMEngine(
        EngineArgs(
            model=str(model_dir),
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            max_model_len=args.prompt_len + args.output_len + 1,
            max_num_seqs=args.num_prompts,
        )
    )
    model = engine.runner.model  # the baselines run the very same weights
    vocab = engine.config.vocab_size
    engine_generate(engine, [[1, 2, 3]], 2)  # warm-up

    num_base = min(args.baseline_prompts, args.num_prompts)
    times: dict[str, list[float]] = {"engine": [], "incremental": [], "naive": []}
    match = True
    for run in range(args.runs):
        gen = torch.Generator().manual_seed(1000 + run)
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
        t_engine, engine_out = timed(lambda: engine_generate(engine, prompts, args.output_len))
        t_inc, inc_out = timed(lambda: incremental_generate(model, prompts[:num_base], args.output_len))
        t_naive, naive_out = timed(lambda: naive_generate(model, prompts[:num_base], args.output_len))
        times["engine"].append(t_engine)
        times["incremental"].append(t_inc)
        times["naive"].append(t_naive)
        match &= inc_out == engine_out[:num_base] and naive_out == engine_out[:num_base]
        print(f"run {run + 1}/{args.runs}: engine {t_engine:.2f}s, incremental {t_inc:.2f}s, naive {t_naive:.2f}s",
              file=sys.stderr)

    rows = []
    for method, num_requests in (("engine", args.num_prompts), ("incremental", num_base), ("naive", num_base)):
        median = statistics.median(times[method])
        num_out = num_requests * args.output_len
        rows.append(Row(method, num_requests, num_requests * args.prompt_len, num_out, median, num_out / median,
                        (num_requests * args.prompt_len + num_out) / median, 0.0, match))
    naive_rate = rows[-1].output_tokens_per_s
    for row in rows:
        row.speedup_vs_naive = row.output_tokens_per_s / naive_rate

    print(f"model {args.model} ({args.dtype}, {args.device}, {torch.get_num_threads()} threads), prompt {args.prompt_len} "
          f"tokens, {args.output_len} greedy output tokens, median of {args.runs} runs")
    header = f"| {'method':<11} | {'requests':>8} | {'median s':>8} | {'out tok/s':>9} | {'total tok/s':>11} | {'vs naive':>8} | tokens match |"
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for r in rows:
        print(f"| {r.method:<11} | {r.num_requests:>8} | {r.median_s:>8.2f} | {r.output_tokens_per_s:>9.1f} | "
              f"{r.total_tokens_per_s:>11.1f} | {r.speedup_vs_naive:>7.1f}x | {str(r.tokens_match):<12} |")
    prefill_rows = measure_prompt_logprobs(engine, args, vocab) if args.prompt_logprobs is not None else []
    if prefill_rows:
        print(f"\nprefill to the first token, prompt {args.prompt_len} tokens x {args.num_prompts}, median of "
              f"{args.runs} runs")
        print(f"| {'prompt_logprobs':<15} | {'median s':>8} | {'prompt tok/s':>12} | all scored |")
        print(f"|{'-' * 17}|{'-' * 10}|{'-' * 14}|{'-' * 12}|")
        for r in prefill_rows:
            print(f"| {str(r.prompt_logprobs):<15} | {r.median_s:>8.2f} | {r.prompt_tokens_per_s:>12.1f} | "
                  f"{str(r.all_scored):<10} |")
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "out"}
        with open(args.out, "w") as f:
            json.dump({"config": config, "threads": torch.get_num_threads(), "rows": [asdict(r) for r in rows],
                       "prefill_rows": [asdict(r) for r in prefill_rows]}, f, indent=2)
    return 0 if match and all(r.all_scored for r in prefill_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
