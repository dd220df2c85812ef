"""Speculative decoding on the CPU: each method against plain decoding, same engine settings, same run.

    python benchmarks/spec_decode.py [--concurrency 1 4] [--num-speculative-tokens 4] [--output-len 64]
        [--prompt-len 64] [--runs 3] [--methods ngram eagle dspark draft_model] [--out results.json]

Two models: `k3-tiny` with `make_checkpoint`'s echo_weight 0.3 (it repeats itself for a while: prompt lookup is
accepted, and rejected where a run changes) and plain random `k3-tiny` (it almost never repeats: prompt lookup
rarely proposes anything, the overhead case). The model-based methods' drafters: for the echo model ones that
propose the last token again (`make_drafter_checkpoint` echo_weight 3.0; draft_model: a 3-layer echo k3-tiny of
another seed), for random k3-tiny random ones (their drafts are rarely right: the drafter's overhead). Prompts are
repetitive (a random phrase of 8 tokens repeated).
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
from k3serve.model.draft.checkpoint import make_drafter_checkpoint

ECHO_WEIGHT = 0.3
DRAFTER_ECHO_WEIGHT = 3.0
METHODS = ("ngram", "eagle", "dspark", "draft_model")


@dataclass
class Row:
    model: str
    method: str  # "none": plain decoding
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


def drafters_for(checkpoint: Path, out: Path, echo: bool) -> dict[str, Path]:
    """The model-based methods' drafters for `checkpoint` (echo: ones that propose the last token again)."""
    weight = DRAFTER_ECHO_WEIGHT if echo else 0.0
    drafters = {m: make_drafter_checkpoint(m, checkpoint, out / m, seed=1, echo_weight=weight)
                for m in ("eagle", "dspark")}
    drafters["draft_model"] = make_checkpoint("k3-tiny", out / "draft_model", seed=1, num_layers=3,
                                              echo_weight=ECHO_WEIGHT if echo else 0.0)
    return drafters


def measure(model: str, checkpoint: Path, drafters: dict[str, Path], args: argparse.Namespace) -> list[Row]:
    base = dict(model=str(checkpoint), dtype="float32", max_model_len=1024, cache_memory_bytes=64 << 20,
                enable_prefix_caching=False)
    k = args.num_speculative_tokens
    plain = LLMEngine(EngineArgs(**base))
    specs = {m: LLMEngine(EngineArgs(**base, speculative_config={"method": m, "num_speculative_tokens": k} | (
        {"model": str(drafters[m])} if m in drafters else {}))) for m in args.methods}
    for engine in (plain, *specs.values()):
        _generate(engine, _prompts(99, 1, args.prompt_len), 8)  # warm-up
    rows = []
    for c in args.concurrency:
        times: dict[str, list[float]] = {m: [] for m in ("none", *specs)}
        match = dict.fromkeys(specs, True)
        before = {m: (e.spec_stats.num_drafts, e.spec_stats.num_accepted_tokens) for m, e in specs.items()}
        for run in range(args.runs):  # the methods alternate with plain decoding, run by run
            prompts = _prompts(run, c, args.prompt_len)
            want, t_plain = _generate(plain, prompts, args.output_len)
            times["none"].append(t_plain)
            for m, engine in specs.items():
                got, t_spec = _generate(engine, prompts, args.output_len)
                times[m].append(t_spec)
                match[m] &= got == want
        plain_tps = args.output_len / statistics.median(times["none"])
        rows.append(Row(model, "none", c, 0, plain_tps, None, None, 1.0, True))
        for m, engine in specs.items():
            drafts = engine.spec_stats.num_drafts - before[m][0]
            al = 1.0 + (engine.spec_stats.num_accepted_tokens - before[m][1]) / drafts if drafts else None
            spec_tps = args.output_len / statistics.median(times[m])
            rows.append(Row(model, m, c, k, spec_tps, al, plain_tps * al if al else None, spec_tps / plain_tps,
                            match[m]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, echo in (("k3-tiny-echo", ECHO_WEIGHT), ("k3-tiny", 0.0)):
            checkpoint = make_checkpoint("k3-tiny", Path(tmp) / model, seed=0, echo_weight=echo)
            rows += measure(model, checkpoint, drafters_for(checkpoint, Path(tmp) / f"{model}-drafters", echo > 0),
                            args)
    print(f"{'model':14} {'method':11} {'c':>3} {'K':>2} {'tok/s/user':>11} {'AL':>5} {'ceiling':>8} {'speedup':>8} "
          "match")
    for r in rows:
        al = f"{r.mean_acceptance_length:5.2f}" if r.mean_acceptance_length else "    -"
        ceiling = f"{r.ceiling_tokens_per_s_per_user:8.1f}" if r.ceiling_tokens_per_s_per_user else "       -"
        print(f"{r.model:14} {r.method:11} {r.concurrency:3d} {r.num_speculative_tokens:2d} "
              f"{r.tokens_per_s_per_user:11.1f} {al} {ceiling} {r.speedup:8.2f} {r.tokens_match}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")


if __name__ == "__main__":
    main()
