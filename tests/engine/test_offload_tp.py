"""The host tier on a TP2 engine (rank 0 here, rank 1 a spawned process; gloo on the CPU): every rank copies its own
shard out and in within the step, and a load is a hit only if it verified on every rank. A corrupted entry on rank 1
alone is a miss for the engine; the tokens are a TP1 engine's without prefix caching either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.tp_group import TPGroup

from _local_ranks import spawned, tcp_init_method

pytestmark = pytest.mark.timeout(120)

FIRST = [(i * 37) % 500 + 3 for i in range(45)]  # its unit: 40 tokens (block_size 8)
SECONDS = [FIRST + [7, 8, 9, 10], FIRST + [11, 12, 13]]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _args(checkpoint: Path, **overrides) -> EngineArgs:
    return EngineArgs(model=str(checkpoint), block_size=8, max_model_len=128, cache_memory_bytes=16 << 20,
                      dtype="float32", **overrides)


def _follower(rank: int, args: EngineArgs, init_method: str) -> None:
    from k3serve.engine.follower import join_engine
    from k3serve.engine.tp_group import follow_forever

    group, runner, _ = join_engine(rank, args, init_method, num_threads=1)

    def corrupt() -> None:  # this rank's host copy of every block, one value each
        runner.offload["host"].cache.mla_kv[0][:, 1, 2] += 1.0
        group.gather(None)

    try:
        follow_forever(group, {"step": lambda output, want: runner.execute(output, want), "corrupt": corrupt})
    finally:
        runner.close_offload()
        group.close()


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    out = {rid: ([], 0) for rid in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens, _ = out[delta.request_id]
            out[delta.request_id] = (tokens + delta.new_token_ids, delta.num_cached_tokens)
    return [out[rid] for rid in ids]


def test_a_tp2_host_hit_is_exact_and_a_corruption_on_one_rank_is_a_miss(tiny_checkpoint: Path):
    want = [tokens for tokens, _ in _generate(LLMEngine(_args(tiny_checkpoint, enable_prefix_caching=False)), SECONDS)]
    args = _args(tiny_checkpoint, tensor_parallel_size=2, kv_offload="host")
    init = tcp_init_method()
    with spawned(_follower, 1, args, init):
        engine = LLMEngine(args, TPGroup(0, 2, init, timeout_s=30))
        try:
            _generate(engine, [FIRST])
            engine.scheduler.prefix_cache.clear()
            hit = _generate(engine, SECONDS[:1])
            assert hit == [(want[0], 40)]
            engine.scheduler.prefix_cache.clear()
            engine.runner.group.lead(("corrupt",))
            engine.runner.group.gather(None)
            miss = _generate(engine, SECONDS[1:])
            assert miss == [(want[1], 0)] and engine.offload.counts["host"].misses == 1
            assert engine.scheduler.block_pool.num_used == 0 and engine.scheduler.state_pool.num_used == 0
        finally:
            engine.close()
