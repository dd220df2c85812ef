"""Speculative decoding on the CPU: prompt lookup (ngram) against plain decoding, same engine settings, same run.

    python benchmarks/spec_decode.py [--concurrency 1 4] [--num-speculative-tokens 4] [--output-len 64]
        [--prompt-len 64] [--runs 3] [--out results.json]

Two models: `k3-tiny` with `make_checkpoint`'s echo_weight 0.3 (it repeats itself for a while: prompt lookup is
accepted, and rejected where a run changes) and plain random `k3-tiny` (it almost never repeats: prompt lookup
rarely proposes anything, the overhead case). Prompts are repetitive (a random phrase of 8 tokens repeated).
For each model and concurrency c (c requests at once, greedy, ignore_eos): output tokens/s per user with and
without `speculative_config`, the mean acceptance length (tokens a verify row emitted), and the ceiling
`plain x AL` (what the speedup would be if a verify step cost a decode step). The speculative tokens must equal
the plain ones ("tokens match"). Each figure is the median of `runs`; engines are built and warmed up untimed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.checkpoint import make_checkpoint

ECHO_WEIGHT = 0.3


@dataclass
class Row:
    model: str
    concurrency: int
    num_speculative_tokens: int  # 0: plain decoding
    tokens_per_s_per_user: float
    mean_acceptance_length: float | None
    ceiling_tokens_per_s_per_user: float | None  # plain x AL
    speedup: float  # over plain, same model and concurrency
    tokens_match: bool


def _prompts(run: int, concurrency: int, prompt_len: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1000 * run + concurrency)
    return [(torch.randint(0, 512, (8,), generator=gen).tolist() * prompt_len)[:prompt_len] for _ in range(concurrency)]


def _generate(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
    return [tokens[i] for i in ids], time.perf_counter() - start


def measure(model: str, checkpoint: Path, args: argparse.Namespace) -> list[Row]:
    base = dict(model=str(checkpoint), dtype="float32", max_model_len=1024, cache_memory_bytes=64 << 20,
                enable_prefix_caching=False)
    plain = LLMEngine(EngineArgs(**base))
    spec = LLMEngine(EngineArgs(**base, speculative_config={"method": "ngram",
                                                            "num_speculative_tokens": args.num_speculative_tokens}))
    for engine in (plain, spec):
        _generate(engine, _prompts(99, 1, args.prompt_len), 8)  # warm-up
    rows = []
    for c in args.concurrency:
        times = {0: [], 1: []}
        match = True
        drafts0, accepted0 = spec.spec_stats.num_drafts, spec.spec_stats.num_accepted_tokens
        for run in range(args.runs):
            prompts = _prompts(run, c, args.prompt_len)
            want, t_plain = _generate(plain, prompts, args.output_len)
            got, t_spec = _generate(spec, prompts, args.output_len)
            times[0].append(t_plain)
            times[1].append(t_spec)
            match &= got == want
        drafts = spec.spec_stats.num_drafts - drafts0
        al = 1.0 + (spec.spec_stats.num_accepted_tokens - accepted0) / drafts if drafts else None
        plain_tps = args.output_len / statistics.median(times[0])
        spec_tps = args.output_len / statistics.median(times[1])
        rows.append(Row(model, c, 0, plain_tps, None, None, 1.0, True))
        rows.append(Row(model, c, args.num_speculative_tokens, spec_tps, al, plain_tps * al if al else None,
                        spec_tps / plain_tps, match))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, echo in (("k3-tiny-echo", ECHO_WEIGHT), ("k3-tiny", 0.0)):
            checkpoint = make_checkpoint("k3-tiny", Path(tmp) / model, seed=0, echo_weight=echo)
            rows += measure(model, checkpoint, args)
    print(f"{'model':14} {'c':>3} {'K':>2} {'tok/s/user':>11} {'AL':>5} {'ceiling':>8} {'speedup':>8} match")
    for r in rows:
        al = f"{r.mean_acceptance_length:5.2f}" if r.mean_acceptance_length else "    -"
        ceiling = f"{r.ceiling_tokens_per_s_per_user:8.1f}" if r.ceiling_tokens_per_s_per_user else "       -"
        print(f"{r.model:14} {r.concurrency:3d} {r.num_speculative_tokens:2d} {r.tokens_per_s_per_user:11.1f} {al} "
              f"{ceiling} {r.speedup:8.2f} {r.tokens_match}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")


if __name__ == "__main__":
    main()
