"""Decode step latency of a TP2 engine on two GPUs (model `K3_TINY_GPU`, bf16), by how its ranks combine
their partial sums: rank 0 in this process on cuda:0, rank 1 a spawned process on cuda:1.

    python benchmarks/gpu_tp.py [--batches 1,8,16] [--steps 30] [--out gpu_tp.json] [--smoke]

    gloo          K3SERVE_TP_NCCL=0, the opt-out (engine/tp_group.py): every all-reduce and the logits gather
                  copy through the host over TCP; no CUDA graphs (they cannot record gloo)
    nccl eager    K3SERVE_TP_NCCL=1 (NCCL is the default): NCCL collectives, every step launched from Python
                  (enforce_eager)
    nccl graphs   NCCL collectives recorded in the decode CUDA graphs: what a TP2 CUDA engine runs by default

Step = one `LLMEngine.step()` (schedule, the forward pass on both ranks, the logits gathered to rank 0,
sampling) while all B requests decode, wall clock, median of --steps after 3 warm-up steps; prompts of 32
tokens. The tiny model makes the step almost all overhead (launches, collectives, host round trips): what
the three columns differ in. Each row says which group the model's collectives ran on and how many decode
steps replayed graphs (0 unless graphs). `--smoke` runs it on the CPU in fp32 (gloo only, no graphs:
checks the code, measures nothing).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3serve.cluster.local_followers import start_tp_engine  # noqa: E402
from k3serve.engine.config import EngineArgs  # noqa: E402
from k3serve.engine.llm_engine import LLMEngine  # noqa: E402
from k3serve.engine.sampling_params import SamplingParams  # noqa: E402
from k3serve.engine.tp_group import NCCL_SWITCH  # noqa: E402
from k3serve.model.checkpoint import make_checkpoint  # noqa: E402
from k3serve.model.presets import K3_TINY_GPU  # noqa: E402

WARM_UP, PROMPT_LEN = 3, 32
VOCAB = K3_TINY_GPU["text_config"]["vocab_size"]
MODES = {"gloo": ("0", False), "nccl eager": ("1", True), "nccl graphs": ("1", False)}  # name: (switch, eager)


def follower(rank: int, args: EngineArgs, init_method: str, on_started: Callable[[], None]) -> None:
    """Rank 1: its shard, then rank 0's steps until "stop"."""
    from k3serve.engine.follower import join_engine
    from k3serve.engine.tp_group import follow_forever

    group, runner, _ = join_engine(rank, args, init_method, num_threads=1)
    on_started()
    follow_forever(group, {"step": lambda output, want: runner.execute(output, want)})


def step_ms(engine: LLMEngine, batch: int, steps: int) -> float:
    """Median wall time of a step while `batch` requests decode (after their prefill and WARM_UP steps)."""
    params = SamplingParams(temperature=0.0, max_tokens=1 + WARM_UP + steps, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        engine.add_request(torch.randint(0, VOCAB, (PROMPT_LEN,), generator=gen).tolist(), params)
    engine.step()  # every prompt in one step (budget), its first token sampled: decode from here on
    for _ in range(WARM_UP):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def run_mode(mode: str, kw: dict, batches: list[int], steps: int) -> dict:
    switch, eager = MODES[mode]
    os.environ[NCCL_SWITCH] = switch  # read by both ranks as the group joins (the follower inherits it)
    args = EngineArgs(**kw, tensor_parallel_size=2, enforce_eager=eager)
    engine, followers = start_tp_engine(mode, 2, "127.0.0.1", follower, lambda rank, init: (rank, args, init),
                                        lambda group: LLMEngine(args, group))
    row = {"collectives": type(engine.runner.model.tp.group).__name__}
    try:
        row["step_ms"] = {b: step_ms(engine, b, steps) for b in batches}
        row["graph_replays"] = engine.runner.graphs.num_replays if engine.runner.graphs else 0
    finally:
        engine.close()
        del engine
        row["rank1_exit_code"] = followers.stop(60)[1]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,16", help="decode batch sizes (--smoke: 1,2)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per batch size (--smoke: 3)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--smoke", action="store_true", help="CPU, fp32: checks the code, measures nothing")
    opts = parser.parse_args()
    batches = [int(b) for b in ("1,2" if opts.smoke else opts.batches).split(",")]
    steps = 3 if opts.smoke else opts.steps
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_checkpoint(copy.deepcopy(K3_TINY_GPU), Path(tmp) / "k3-tiny-gpu", seed=0)
        kw = dict(model=str(checkpoint), max_model_len=256, max_num_seqs=max(batches),
                  max_num_batched_tokens=max(batches) * PROMPT_LEN, cache_memory_bytes=256 * 2**20, seed=0,
                  device="cpu" if opts.smoke else "cuda", dtype="float32" if opts.smoke else "bfloat16")
        rows = {mode: run_mode(mode, kw, batches, steps) for mode in MODES}
    print(f"TP2 decode step, K3_TINY_GPU {'fp32 on CPU (smoke)' if opts.smoke else 'bf16'}, {PROMPT_LEN}-token "
          f"prompts, median of {steps} steps (ms)")
    print(f"{'batch':>5} | " + " | ".join(f"{mode:>12}" for mode in MODES) + " | graphs vs gloo")
    for b in batches:
        ms = [rows[mode]["step_ms"][b] for mode in MODES]
        print(f"{b:>5} | " + " | ".join(f"{t:12.3f}" for t in ms) + f" | {ms[0] / ms[-1]:13.1f}x")
    for mode, row in rows.items():
        print(f"{mode}: model collectives on {row['collectives']}, {row['graph_replays']} decode steps replayed, "
              f"rank 1 exited with {row['rank1_exit_code']}")
    if opts.out:
        opts.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
