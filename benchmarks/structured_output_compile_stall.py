"""How long a running request's decoding stalls while a structured output constraint compiles (CPU, tiny model).

    python benchmarks/structured_output_compile_stall.py [--vocab 163840] [--repeats 3] [--out results.json]

An `AsyncEngine` on the tiny model decodes one unconstrained request; once it streams steadily, a request under a
JSON schema the engine has not compiled yet arrives. Measured at the running request's consumer: the longest gap
between two of its tokens from that arrival until the constrained request's first token, against the median gap
before the arrival. Two cases, in this order in one process:

    first   the engine's first constrained request: xgrammar imported, the vocabulary (TokenizerInfo) built, the
            schema compiled
    new     a later request under a schema not seen before: the schema compiled

The engine's structured outputs are built over `structured_output_mask.SyntheticVocabulary` at `--vocab` ids (the
tiny tokenizer's 512 first, so the mask is right for the tiny model's logits, which are its first 512 columns): a
compile at K3's vocabulary size, not Kimi's own tokenizer. `first` runs once a process; `--repeats` processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from structured_output_mask import SCHEMA, SyntheticVocabulary  # noqa: E402

from k3serve.engine.async_engine import AsyncEngine  # noqa: E402
from k3serve.engine.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from k3serve.engine.stream_types import GenerateRequest  # noqa: E402
from k3serve.engine.structured_output import StructuredOutputs  # noqa: E402
from k3serve.model.checkpoint import make_checkpoint  # noqa: E402
from k3serve.model.tokenizer import Tokenizer  # noqa: E402

WARMUP_TOKENS = 30  # the running request's tokens before the constrained one arrives


def schema_variant(case: str) -> dict:
    """SCHEMA with one more property, so each case compiles a schema the engine has not seen."""
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"][f"extra_{case}"] = {"type": "string", "maxLength": 20}
    return schema


async def measure_case(engine: AsyncEngine, case: str) -> dict[str, float]:
    running = GenerateRequest(f"running-{case}", list(range(20, 60)),
                              SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True))
    constrained = GenerateRequest(f"constrained-{case}", list(range(30, 50)), SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema_variant(case))))
    arrival: float | None = None
    first_constrained = asyncio.get_running_loop().create_future()
    times: list[float] = []

    async def follow_constrained() -> None:
        async for delta in engine.generate(constrained):
            if not first_constrained.done():
                first_constrained.set_result(time.perf_counter())
            if delta.finished:
                return

    constrained_task = None
    async for _ in engine.generate(running):
        times.append(time.perf_counter())
        if len(times) == WARMUP_TOKENS:
            arrival = time.perf_counter()
            constrained_task = asyncio.create_task(follow_constrained())
        if first_constrained.done() and times[-1] > first_constrained.result() + 0.05:
            break
    await engine.abort(running.request_id)
    await constrained_task
    ready = first_constrained.result()
    before = [b - a for a, b in zip(times[: WARMUP_TOKENS - 1], times[1:WARMUP_TOKENS])]
    during = [b - a for a, b in zip(times, times[1:]) if b > arrival and a < ready]
    return {"median_gap_ms": statistics.median(before) * 1e3, "max_gap_ms": max(during) * 1e3,
            "constrained_first_token_ms": (ready - arrival) * 1e3, "tokens_while_compiling": len(during) - 1}


async def one_process(model_dir: Path, vocab: int) -> dict[str, dict[str, float]]:
    engine = AsyncEngine(model=str(model_dir), dtype="float32", max_model_len=4096, device="cpu",
                         cache_memory_bytes=64 * 2**20)
    try:
        tokenizer = SyntheticVocabulary(Tokenizer.from_dir(model_dir), vocab)

        def use_synthetic_vocabulary(e) -> None:
            e.structured_outputs = StructuredOutputs(tokenizer, vocab)

        await engine.call(use_synthetic_vocabulary)
        return {case: await measure_case(engine, case) for case in ("first", "new")}
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=163840)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the engine")
    parser.add_argument("--model-cache", default="/tmp/k3serve-bench-tiny")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one repeat
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    model_dir = Path(args.model_cache)
    if args.one:
        torch.set_num_threads(args.threads)
        print(json.dumps(asyncio.run(one_process(model_dir, args.vocab))))
        return 0
    if not (model_dir / "tokenizer.json").is_file():
        make_checkpoint("k3-tiny", model_dir, seed=0)
    runs = []
    for _ in range(args.repeats):  # a fresh process each: "first" pays the import and the vocabulary
        child = [sys.executable, __file__, "--one", "--vocab", str(args.vocab), "--threads", str(args.threads),
                 "--model-cache", str(model_dir)]
        runs.append(json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout))
    for case in ("first", "new"):
        rows = [run[case] for run in runs]
        print(f"{case:>5}  " + "  ".join(f"{k}=" + "/".join(f"{r[k]:.1f}" for r in rows) for k in rows[0]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
