"""The offload tiers under disaggregated serving (real router, in-process workers, transfer "local", the tiny model):
a second turn whose prefix the prefill pool evicted from device memory is routed to the replica that holds it
(prefix-aware routing), served from its host tier with `num_cached_tokens` > 0, and its tokens equal a colocated
engine's with no cache at all; nothing is left held on either pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from k3serve.cluster.router import DisaggregatedRouter
from k3serve.decode.worker import DecodeWorker
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer
from k3serve.prefill.worker import PrefillWorker

pytestmark = pytest.mark.timeout(180)

ENGINE_ARGS = dict(block_size=16, max_model_len=512, cache_memory_bytes=32 << 20)
FIRSTS = [[(i * 31 + j * 7) % 450 + 20 for j in range(40 + 9 * i)] for i in range(4)]
SECONDS = [p + [(k * 13 + i) % 400 + 30 for k in range(10)] for i, p in enumerate(FIRSTS)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def unit_tokens(prompt: list[int]) -> int:
    return (len(prompt) - 1) // 16 * 16


def on_engine(worker, fn):
    """`fn(engine)` on the worker's engine thread."""
    return worker.handoff.submit(lambda: fn(worker.handoff._engine.engine)).result(timeout=30)


@pytest.fixture(scope="module")
def pools(tiny_checkpoint: Path):
    prefill_args = EngineArgs(model=str(tiny_checkpoint), kv_offload="host", **ENGINE_ARGS)
    prefill = [PrefillWorker(prefill_args, transfer="local", name=f"prefill-{i}") for i in range(2)]
    decode = DecodeWorker(EngineArgs(model=str(tiny_checkpoint), **ENGINE_ARGS), transfer="local", name="decode-0")
    yield prefill, decode
    for worker in (*prefill, decode):
        worker.shutdown()


def test_an_evicted_prefix_is_routed_to_its_replica_and_served_from_host_memory(pools, tiny_checkpoint):
    prefill, decode = pools
    vocab = ModelConfig.from_dir(tiny_checkpoint).vocab_size
    want = LLM(str(tiny_checkpoint), enable_prefix_caching=False, **ENGINE_ARGS).generate(SECONDS, [GREEDY] * 4)

    async def run():
        router = DisaggregatedRouter(prefill, [decode], Tokenizer.from_dir(tiny_checkpoint), "k3-tiny",
                                     ENGINE_ARGS["max_model_len"], vocab, block_size=16)
        try:
            for i, p in enumerate(FIRSTS):
                [d async for d in router.generate(GenerateRequest(f"first-{i}", p, GREEDY))]
            for worker in prefill:  # evicted from device memory: only the host tiers hold the units
                on_engine(worker, lambda e: e.scheduler.prefix_cache.clear())
            return [[d async for d in router.generate(GenerateRequest(f"second-{i}", p, GREEDY))]
                    for i, p in enumerate(SECONDS)]
        finally:
            await router.close()

    runs = asyncio.run(asyncio.wait_for(run(), 150))
    assert [[t for d in deltas for t in d.new_token_ids] for deltas in runs] == [o.outputs[0].token_ids for o in want]
    assert [deltas[-1].num_cached_tokens for deltas in runs] == [unit_tokens(p) for p in FIRSTS]
    hits = [on_engine(w, lambda e: e.offload.counts["host"].hits) for w in prefill]
    assert sum(hits) == sum(map(unit_tokens, FIRSTS))
    for worker in (*prefill, decode):
        held = on_engine(worker, lambda e: (e.scheduler.block_pool.num_used, e.scheduler.state_pool.num_used))
        assert held == (0, 0), (worker.name, held)


@pytest.mark.slow  # a real store server
def test_a_unit_one_prefill_replica_put_in_mooncake_store_is_served_by_another(tiny_checkpoint, tmp_path):
    pytest.importorskip("mooncake.store")
    from _mooncake_master import Master

    master = Master(tmp_path)
    args = EngineArgs(model=str(tiny_checkpoint), kv_offload="mooncake", kv_offload_mooncake_config=master.config,
                      **ENGINE_ARGS)
    writer, reader = (PrefillWorker(args, transfer="local", name=f"prefill-{i}") for i in range(2))
    decode = DecodeWorker(EngineArgs(model=str(tiny_checkpoint), **ENGINE_ARGS), transfer="local", name="decode-0")
    vocab = ModelConfig.from_dir(tiny_checkpoint).vocab_size
    want = LLM(str(tiny_checkpoint), enable_prefix_caching=False, **ENGINE_ARGS).generate(SECONDS, [GREEDY] * 4)

    async def run(prefill, prompts, prefix):
        router = DisaggregatedRouter([prefill], [decode], Tokenizer.from_dir(tiny_checkpoint), "k3-tiny",
                                     ENGINE_ARGS["max_model_len"], vocab, block_size=16, shared_prefix_store=True)
        try:
            return [[d async for d in router.generate(GenerateRequest(f"{prefix}-{i}", p, GREEDY))]
                    for i, p in enumerate(prompts)]
        finally:
            await router.close()

    try:
        asyncio.run(asyncio.wait_for(run(writer, FIRSTS, "first"), 60))
        runs = asyncio.run(asyncio.wait_for(run(reader, SECONDS, "second"), 60))
        assert [[t for d in deltas for t in d.new_token_ids] for deltas in runs] == [o.outputs[0].token_ids for o in want]
        assert [deltas[-1].num_cached_tokens for deltas in runs] == [unit_tokens(p) for p in FIRSTS]
        assert on_engine(reader, lambda e: e.offload.counts["mooncake"].hits) == sum(map(unit_tokens, FIRSTS))
    finally:
        for worker in (writer, reader, decode):
            worker.shutdown()
        master.stop()
