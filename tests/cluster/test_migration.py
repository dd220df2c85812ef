"""Request migration (`cluster/migration.py`): a stream whose decode replica dies continues on another one.

Real in-process workers (1 prefill, 2 decode, transfer "local", the tiny model) and a real router; the decode
replica serving the stream is killed after some tokens (`_faulty_replicas.KillableDecode`: its feed is cut
as Ray cuts a dead actor's, the worker shuts down, later calls fail).

- Greedy and seeded sampling: the client's tokens and text are exactly the colocated engine's, and the counts
  in the deltas go on from the tokens already sent.
- Over HTTP: the stream completes with the colocated greedy text; with `migrate_on_decode_failure` off it ends
  with a clean error event (503) instead.
- A request that cannot be continued exactly (stop strings) ends with the replica's error.
- The continuation: its seed draws what the original's draws k positions later, its budget is what is left, its
  deltas count from the original prompt; which requests are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest
import torch
import uvicorn

from k3serve.cluster.api import build_app
from k3serve.cluster.errors import ReplicaDiedError
from k3serve.cluster.metrics import IngressMetrics
from k3serve.cluster.migration import Continuation, refusal
from k3serve.cluster.router import DisaggregatedRouter
from k3serve.decode.worker import DecodeWorker
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.outputs import RequestDelta
from k3serve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer
from k3serve.prefill.worker import PrefillWorker

from _faulty_replicas import KillableDecode, wait_decode_idle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ENGINE_ARGS = dict(block_size=16, max_model_len=512, cache_memory_bytes=64 << 20)
PROMPT = [(j * 11) % 450 + 20 for j in range(30)]
TEXT_PROMPT = "The ships sail on the sea and the sea"
NUM_TOKENS, KILL_AFTER = 40, 9
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_args(tiny_checkpoint: Path) -> EngineArgs:
    return EngineArgs(model=str(tiny_checkpoint), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def prefill(engine_args):
    worker = PrefillWorker(engine_args, transfer="local", name="prefill-0")
    yield worker
    worker.shutdown()


@pytest.fixture(scope="module")
def survivor(engine_args):
    worker = DecodeWorker(engine_args, transfer="local", name="decode-1")
    yield worker
    worker.shutdown()


@pytest.fixture
def victim(engine_args):
    """The decode replica the router picks first (listed first, as idle as the other)."""
    replica = KillableDecode(DecodeWorker(engine_args, transfer="local", name="decode-0"))
    yield replica
    if not replica.killed.is_set():
        replica.worker.shutdown()


@pytest.fixture(scope="module")
def colocated(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), **ENGINE_ARGS)


def _router(prefill, victim, survivor, tiny_checkpoint: Path, **kwargs) -> DisaggregatedRouter:
    return DisaggregatedRouter([prefill], [victim, survivor], Tokenizer.from_dir(tiny_checkpoint), "k3-tiny",
                               ENGINE_ARGS["max_model_len"], ModelConfig.from_dir(tiny_checkpoint).vocab_size,
                               **kwargs)


async def _stream_killing(router: DisaggregatedRouter, victim: KillableDecode, rid: str,
                          params: SamplingParams) -> tuple[list[int], str]:
    """The request's tokens and text, the victim killed once KILL_AFTER tokens arrived; checks the counts."""
    tokens, text = [], ""
    async for delta in router.generate(GenerateRequest(rid, PROMPT, params)):
        tokens += delta.new_token_ids
        text += delta.new_text
        assert (delta.request_id, delta.num_prompt_tokens, delta.num_output_tokens) == (rid, len(PROMPT), len(tokens))
        if len(tokens) == KILL_AFTER:
            await victim.kill()
    return tokens, text


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_stream_whose_decode_replica_dies_continues_with_the_colocated_output(
    prefill, victim, survivor, colocated, tiny_checkpoint: Path, params
) -> None:
    expected = colocated.generate([PROMPT], params)[0].outputs[0]
    router = _router(prefill, victim, survivor, tiny_checkpoint, metrics=IngressMetrics())
    try:
        tokens, text = await _stream_killing(router, victim, f"migrated-{params.seed}", params)
    finally:
        await router.close()
    assert tokens == expected.token_ids
    assert text == expected.text
    assert router.metrics.registry.get_sample_value("k3serve:request_migrations_total", {"model_name": ""}) == 1
    await wait_decode_idle(survivor)


async def test_a_request_with_stop_strings_is_not_migrated(prefill, victim, survivor, tiny_checkpoint: Path) -> None:
    router = _router(prefill, victim, survivor, tiny_checkpoint)
    try:
        with pytest.raises(ReplicaDiedError):
            await _stream_killing(router, victim, "with-stop", SamplingParams(
                temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=["never appears \x00"]))
    finally:
        await router.close()


@contextlib.asynccontextmanager
async def _serving(router: DisaggregatedRouter) -> AsyncIterator[str]:
    """The OpenAI app over `router` behind a real uvicorn server (ASGITransport would buffer the stream)."""
    app = build_app(router, IngressMetrics(model_name="k3-tiny"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def _http_stream(router: DisaggregatedRouter, victim: KillableDecode) -> tuple[str, list[dict]]:
    """A streamed greedy completion over the OpenAI API; the victim killed after KILL_AFTER chunks."""
    body = {"model": "k3-tiny", "prompt": TEXT_PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events, text = [], ""
    async with _serving(router) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if "choices" in events[-1]:
                    text += events[-1]["choices"][0]["text"]
                if len(events) == KILL_AFTER:
                    await victim.kill()
    assert victim.killed.is_set() and len(events) > KILL_AFTER, "the stream ended before the kill"
    return text, events


async def test_over_http_the_stream_completes_with_the_colocated_text(
    prefill, victim, survivor, colocated, tiny_checkpoint: Path
) -> None:
    router = _router(prefill, victim, survivor, tiny_checkpoint)
    try:
        text, events = await _http_stream(router, victim)
    finally:
        await router.close()
    expected = colocated.generate([TEXT_PROMPT], GREEDY)[0].outputs[0].text
    assert text == expected
    assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]


async def test_over_http_with_migration_off_the_stream_ends_with_a_clean_error(
    prefill, victim, survivor, tiny_checkpoint: Path
) -> None:
    router = _router(prefill, victim, survivor, tiny_checkpoint, migrate_on_decode_failure=False)
    try:
        _, events = await _http_stream(router, victim)
    finally:
        await router.close()
    assert "error" in events[-1] and events[-1]["error"]["code"] == 503, events[-3:]
    assert "died" in events[-1]["error"]["message"], events[-1]


@pytest.mark.parametrize("seed, k", [(0, 1), (1234, 9), ((1 << 63) - 1, 500), (-7, 3)])
def test_a_continuation_seed_draws_what_the_original_draws_k_positions_later(seed: int, k: int) -> None:
    from k3serve.engine.llm_engine import _position_generator
    from k3serve.engine.seeds import continuation_seed

    for j in range(3):
        ours = torch.rand(4, generator=_position_generator(continuation_seed(seed, k), j))
        assert torch.equal(ours, torch.rand(4, generator=_position_generator(seed, k + j)))


def test_a_continuation_keeps_what_is_left_of_the_budget_and_reports_the_original_counts() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=6, seed=3, prompt_logprobs=1)
    c = Continuation.of([5, 6, 7], params, [8, 9, 10, 11])
    assert c.prompt_token_ids == [5, 6, 7, 8, 9, 10, 11]
    assert (c.params.max_tokens, c.params.min_tokens, c.params.prompt_logprobs) == (6, 2, None)
    delta = c.delta(RequestDelta(request_id="r", new_token_ids=[12], new_text="", finished=False, finish_reason=None,
                                 logprobs=None, num_prompt_tokens=7, num_output_tokens=1))
    assert (delta.num_prompt_tokens, delta.num_output_tokens) == (3, 5)


@pytest.mark.parametrize("params, why", [
    (SamplingParams(stop=["\n"]), "stop strings"),
    (SamplingParams(frequency_penalty=0.5), "penalties"),
    (SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")), "structured output"),
])
def test_requests_that_tokens_alone_cannot_continue_exactly_are_not_migrated(params, why) -> None:
    assert why in refusal(params)
    assert refusal(SamplingParams(repetition_penalty=1.2, min_tokens=3, logit_bias={5: 1.0}, seed=1)) is None
