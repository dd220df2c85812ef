"""Specification: a TP2 engine speculates as a TP1 engine does. Rank 0 alone samples and rejects; every rank runs the
verify forward and then the commit rank 0 announces (`ModelRunner.commit_verified`, the follower loop of
`kv_handoff.FollowerRank`), so the collectives line up and each rank's KDA heads advance by the same accepted
prefix. Greedy tokens equal the TP1 engine's without speculation, drafts were accepted, and the pools end empty;
also with a model-based drafter (rank 0's alone)."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.tp_group import TPGroup

from _llm_harness import assert_engine_empty
from _local_ranks import spawned, tcp_init_method

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[3, 7, 11, 500, 2], list(range(1, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _args(checkpoint: Path, tp: int, spec: dict | None) -> EngineArgs:
    return EngineArgs(model=str(checkpoint), block_size=8, max_model_len=128, cache_memory_bytes=16 << 20,
                      dtype="float32", tensor_parallel_size=tp, speculative_config=spec)


def _follower(rank: int, args: EngineArgs, init_method: str) -> None:
    from k3serve.engine.kv_handoff import join_follower

    follower = join_follower(rank, args, init_method, num_threads=1)
    try:
        follower.serve({})
    finally:
        follower.close()


def _generate(engine: LLMEngine) -> list[list[int]]:
    ids = [engine.add_request(prompt, GREEDY) for prompt in PROMPTS]
    out = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id] += delta.new_token_ids
    return [out[rid] for rid in ids]


@pytest.mark.parametrize(("method", "k"), [("ngram", 4)] + [(m, k) for m in ("eagle", "dspark", "draft_model")
                                                                   for k in (1, 4, 8)])
def test_a_tp2_engine_speculates_and_generates_the_tp1_tokens(echo_checkpoint: Path, drafters: dict[str, Path],
                                                              method: str, k: int) -> None:
    """A drafter runs on rank 0 alone, over full copies of the target's embedding and lm_head."""
    reference = _generate(LLMEngine(_args(echo_checkpoint, 1, None)))
    spec = {"method": method, "num_speculative_tokens": k} | ({"model": str(drafters[method])} if method in drafters
                                                              else {})
    args = _args(echo_checkpoint, 2, spec)
    init = tcp_init_method()
    with spawned(_follower, 1, args, init):
        engine = LLMEngine(args, TPGroup(0, 2, init, timeout_s=30))
        try:
            assert _generate(engine) == reference
            assert engine.spec_stats.num_accepted_tokens > 0
            if method in drafters:
                assert engine.runner.drafter.num_forwards > 0
            assert_engine_empty(engine)
        finally:
            engine.close()
