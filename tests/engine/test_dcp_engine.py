"""Specification: a TP engine whose ranks split MLA's latent KV by sequence (decode context parallelism, gloo ranks
on the CPU) generates the greedy tokens of a TP1 engine with the same blocks: prompts of many pages a rank, a
second wave that hits the prefix cache, a cache so small that requests are preempted and recomputed, and
speculative verify rows. Rank 0 here, ranks > 0 spawned (`join_follower`, as in test_spec_tp.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.tp_group import TPGroup

from _llm_harness import assert_engine_empty, random_prompt
from _local_ranks import spawned, tcp_init_method

pytestmark = pytest.mark.timeout(180)

PAGE = 4  # tokens a rank's block holds: with DCP W a block id holds W * PAGE tokens


def _prompts() -> list[list[int]]:
    """Two waves: 3 prompts of 45-70 tokens sharing a 40-token prefix and an unrelated one, then the shared
    prefix again under new tails (prefix-cache hits at its last full block)."""
    gen = torch.Generator().manual_seed(21)
    prefix = random_prompt(gen, 40)
    first = [prefix + random_prompt(gen, 5), prefix + random_prompt(gen, 30), random_prompt(gen, 70)]
    return first + [prefix + random_prompt(gen, 9), prefix + random_prompt(gen, 2)]


def _args(checkpoint: Path, tp: int, dcp: int, block_size: int = PAGE, num_blocks: int | None = None,
          spec: dict | None = None) -> EngineArgs:
    """A TP `tp` engine whose blocks of `block_size` tokens a rank span `dcp` ranks. With `num_blocks` prompts
    are admitted in chunks of 24 tokens, so that they grow into the cache while others decode."""
    return EngineArgs(model=str(checkpoint), dtype="float32", tensor_parallel_size=tp,
                      decode_context_parallel_size=dcp, block_size=block_size, max_model_len=MAX_MODEL_LEN,
                      cache_memory_bytes=16 << 20, num_gpu_blocks_override=num_blocks,
                      max_num_batched_tokens=64 if num_blocks is None else 24, adaptive_token_budget=False,
                      speculative_config=spec)


def _follower(rank: int, args: EngineArgs, init_method: str) -> None:
    from k3serve.engine.kv_handoff import join_follower

    follower = join_follower(rank, args, init_method, num_threads=1)
    try:
        follower.serve({})
    finally:
        follower.close()


def _generate(engine: LLMEngine, max_tokens: int) -> tuple[list[list[int]], int, int]:
    """(tokens of each prompt, preemptions, prefix-cache tokens hit): the first wave to its end, then the second."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts, out = _prompts(), {}
    for wave in (prompts[:3], prompts[3:]):
        out |= {engine.add_request(p, params): [] for p in wave}
        while engine.has_unfinished():
            for delta in engine.step():
                out[delta.request_id] += delta.new_token_ids
    hits = engine.scheduler.prefix_cache.num_hits
    assert_engine_empty(engine)
    return list(out.values()), engine.num_preemptions, hits


def _generate_dcp(args: EngineArgs, max_tokens: int) -> tuple[LLMEngine, tuple[list[list[int]], int, int]]:
    """The engine (closed) and `_generate` on it, its ranks > 0 spawned."""
    init, tp = tcp_init_method(), args.tensor_parallel_size
    followers = [spawned(_follower, rank, args, init) for rank in range(1, tp)]
    for f in followers:
        f.__enter__()
    try:
        engine = LLMEngine(args, TPGroup(0, tp, init, timeout_s=60))
        try:
            assert engine.runner.cache.mla_kv[0].shape[1] == PAGE  # each rank stores pages, not whole blocks
            return engine, _generate(engine, max_tokens)
        finally:
            engine.close()
    finally:
        for f in reversed(followers):
            f.__exit__(None, None, None)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
MAX_MODEL_LEN = 160
CASES = {  # name: (tp, dcp, tokens of MLA cache (None: all 16 MiB hold), speculative_config)
    "tp2-dcp2-prefix-hits": (2, 2, None, None),
    "tp2-dcp2-preempted": (2, 2, MAX_MODEL_LEN, None),  # one longest request's blocks: the first wave preempts
    "tp2-dcp2-verify-rows": (2, 2, None, NGRAM),
    "tp4-dcp4-preempted": (4, 4, MAX_MODEL_LEN, None),
    "tp4-dcp2-prefix-hits": (4, 2, None, None),  # two DCP groups of two ranks: the KV split in each
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("tp4") else c
                                  for c in CASES])
def test_a_dcp_engine_generates_the_greedy_tokens_of_one_rank_with_the_same_blocks(
    tiny_checkpoint: Path, echo_checkpoint: Path, case: str
) -> None:
    tp, dcp, cache_tokens, spec = CASES[case]
    num_blocks = None if cache_tokens is None else cache_tokens // (PAGE * dcp)
    checkpoint = echo_checkpoint if spec else tiny_checkpoint  # a model that repeats itself accepts drafts
    reference = _generate(LLMEngine(_args(checkpoint, 1, 1, PAGE * dcp, num_blocks)), 8)
    engine, got = _generate_dcp(_args(checkpoint, tp, dcp, PAGE, num_blocks, spec), 8)
    assert got == reference
    tokens, preemptions, hits = got
    assert all(len(t) == 8 for t in tokens)
    assert (preemptions > 0, hits > 0) == ((True, False) if num_blocks else (False, True))  # evicted when tight
    if spec:
        assert engine.spec_stats.num_accepted_tokens > 0
