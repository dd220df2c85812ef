"""Specification: a request that ends early gives back every block and KDA slot it held.

Wherever a request is when it is aborted (waiting, mid-prefill, mid-prefill after a prefix hit,
decoding, preempted), when a streaming consumer stops listening (`aclose`, task cancelled), or
when it is rejected up front (too long, empty, outside the vocabulary), the engine ends with no
request state and empty pools. The other requests in flight are untouched and run to the end.
Each test is followed by the leak check of `_llm_harness` (pools empty, prefix cache cleared).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest

from _llm_harness import (
    cache_bytes_for,
    make_async_engine,  # noqa: F401  (fixture)
    make_llm,  # noqa: F401  (fixture)
    random_prompt,
)

CHUNKED = dict(max_num_batched_tokens=64, max_adaptive_batched_tokens=64, long_prefill_token_threshold=48)
ASYNC_TIMEOUT_S = 60.0  # a stream that never ends fails the test instead of hanging it


def params(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def step_until(engine: LLMEngine, done, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if done():
            return
        engine.step()
    raise AssertionError(f"condition not reached in {max_steps} steps")


def run_to_completion(engine: LLMEngine) -> dict[str, int]:
    """Step until idle; the number of tokens each request that finished meanwhile generated."""
    num_output_tokens: dict[str, int] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                num_output_tokens[delta.request_id] = delta.num_output_tokens
    return num_output_tokens


# ---- LLMEngine.abort_request -----------------------------------------------------------------
@pytest.mark.parametrize("prefix_hit", [False, True], ids=["fresh", "after_prefix_hit"])
def test_abort_mid_prefill_frees_its_blocks_and_slot(make_llm, prefix_hit: bool):
    engine = make_llm(max_num_seqs=4, **CHUNKED).engine
    gen = torch.Generator().manual_seed(1)
    prompt = random_prompt(gen, 1000)
    if prefix_hit:  # leave a KDA checkpoint at 640 (prompt of 700 tokens) for the long prompt to hit
        first = engine.add_request(prompt[:700], params(1))
        assert run_to_completion(engine) == {first: 1}
    bystander = engine.add_request(random_prompt(gen, 30), params(4))
    request_id = engine.add_request(prompt, params())

    engine.step()
    request = engine.scheduler.requests[request_id]
    assert request.num_cached_tokens == (640 if prefix_hit else 0)
    assert request.num_cached_tokens < request.num_computed_tokens < len(prompt), "not mid-prefill"
    assert request.block_ids and request.slot_id is not None

    last = engine.abort_request(request_id)
    assert last.finished and last.finish_reason == "abort" and last.new_token_ids == []
    assert request_id not in engine.scheduler.requests
    assert run_to_completion(engine) == {bystander: 4}  # the other request is unaffected


def test_abort_mid_decode_frees_its_blocks_and_slot(make_llm):
    engine = make_llm().engine
    gen = torch.Generator().manual_seed(2)
    request_id = engine.add_request(random_prompt(gen, 130), params(32))
    bystander = engine.add_request(random_prompt(gen, 70), params(8))
    step_until(engine, lambda: engine.scheduler.requests[request_id].num_output_tokens >= 3)

    last = engine.abort_request(request_id)
    assert last.finish_reason == "abort" and last.num_output_tokens == 3
    assert run_to_completion(engine) == {bystander: 8}


def test_abort_of_a_waiting_request_and_of_an_unknown_one(make_llm):
    engine = make_llm(max_num_seqs=1).engine
    gen = torch.Generator().manual_seed(3)
    running = engine.add_request(random_prompt(gen, 20), params(4))
    waiting = engine.add_request(random_prompt(gen, 20), params(4))
    engine.step()
    assert engine.scheduler.requests[waiting].block_ids == []  # never admitted

    assert engine.abort_request(waiting).finish_reason == "abort"
    assert engine.abort_request(waiting) is None  # twice: already gone
    assert engine.abort_request("no-such-request") is None
    assert run_to_completion(engine) == {running: 4}


def test_abort_of_a_preempted_request(make_llm, tiny_checkpoint: Path):
    """22 MLA blocks for ~2.5k prompt tokens: the last arrival is preempted while decoding."""
    llm = make_llm(max_num_seqs=8, max_model_len=1100, cache_memory_bytes=cache_bytes_for(tiny_checkpoint, 22, 16))
    engine = llm.engine
    gen = torch.Generator().manual_seed(7)
    _ = random_prompt(gen, 300)  # the same draws as the seeded-sampling test, which preempts here
    for n in (1, 40, 126, 250, 700, 1020, 62):
        engine.add_request(random_prompt(gen, n), SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    victim = engine.add_request(random_prompt(gen, 300), params(16))

    step_until(engine, lambda: engine.num_preemptions > 0)
    preempted = [r for r in engine.scheduler.waiting if r.num_preemptions]
    assert [r.request_id for r in preempted] == [victim]
    assert preempted[0].block_ids == [] and preempted[0].slot_id is None

    assert engine.abort_request(victim).finish_reason == "abort"
    assert victim not in run_to_completion(engine)


# ---- AsyncEngine: the consumer goes away -----------------------------------------------------
def test_async_consumer_that_stops_iterating_frees_its_request(make_async_engine):
    engine = make_async_engine()
    prompt = random_prompt(torch.Generator().manual_seed(4), 200)

    async def read_one_delta_then_close():
        stream = engine.generate(GenerateRequest("early-exit", prompt, params(64)))
        first = await asyncio.wait_for(anext(stream), ASYNC_TIMEOUT_S)
        await stream.aclose()  # e.g. the HTTP client disconnected
        return first

    first = asyncio.run(read_one_delta_then_close())
    assert not first.finished and first.num_output_tokens == 1
    # the teardown shuts the engine down after the queued abort and checks that the pools are empty


def test_async_consumer_cancelled_mid_prefill_frees_its_request(make_async_engine):
    engine = make_async_engine(max_num_seqs=4, **CHUNKED)
    prompt = random_prompt(torch.Generator().manual_seed(5), 1500)  # ~32 chunked steps

    async def cancel_while_waiting():
        async def consume():
            return [d async for d in engine.generate(GenerateRequest("cancelled", prompt, params()))]

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_waiting())


def test_async_abort_ends_the_stream_with_finish_reason_abort(make_async_engine):
    engine = make_async_engine()
    prompt = random_prompt(torch.Generator().manual_seed(6), 50)

    async def abort_after_first_delta():
        deltas = []
        async for delta in engine.generate(GenerateRequest("aborted", prompt, params(1000))):
            deltas.append(delta)
            if len(deltas) == 1:
                await engine.abort("aborted")
        return deltas

    deltas = asyncio.run(asyncio.wait_for(abort_after_first_delta(), ASYNC_TIMEOUT_S))
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert all(not d.finished for d in deltas[:-1])


# ---- rejected up front -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_prompt_tokens, max_tokens, match",
    [(2100, 8, "leaves no room"), (2000, 200, "exceeds max_model_len"), (0, 8, "empty")],
    ids=["prompt_too_long", "prompt_plus_max_tokens_too_long", "empty_prompt"],
)
def test_rejected_request_allocates_nothing(make_llm, num_prompt_tokens: int, max_tokens: int, match: str):
    llm = make_llm()
    engine = llm.engine
    bad = random_prompt(torch.Generator().manual_seed(8), num_prompt_tokens)
    with pytest.raises(ValueError, match=match):
        engine.add_request(bad, params(max_tokens))
    assert not engine.has_unfinished()

    good = random_prompt(torch.Generator().manual_seed(9), 10)
    with pytest.raises(ValueError, match=match):  # all or nothing: the good prompt is not left queued
        llm.generate([good, bad], params(max_tokens))
    assert not engine.has_unfinished()
    assert len(llm.generate(good, params(3))[0].outputs[0].token_ids) == 3  # and the engine still serves


def test_token_ids_outside_the_vocabulary_are_rejected(make_llm):
    engine = make_llm().engine
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 2, 512], params())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([-1], params())


def test_async_rejected_request_raises_and_the_engine_keeps_serving(make_async_engine):
    engine = make_async_engine()

    async def too_long_then_fine():
        with pytest.raises(ValueError, match="leaves no room"):
            async for _ in engine.generate(GenerateRequest("too-long", [1] * 2100, params())):
                pass
        return [d async for d in engine.generate(GenerateRequest("fine", [1, 2, 3], params(2)))]

    deltas = asyncio.run(asyncio.wait_for(too_long_then_fine(), ASYNC_TIMEOUT_S))
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 2
