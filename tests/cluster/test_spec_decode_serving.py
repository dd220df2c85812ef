"""Specification: speculative decoding through the OpenAI API and across the disaggregated handoff.

Colocated: /v1/completions with `speculative_config` (prompt lookup, K = 1, 4, 8) answers greedy requests exactly
as the same engine without it, stop strings inside an accepted run, n = 2 and logprobs included. Disaggregated
(real router, in-process 1P1D workers, local transfer): the decode engine speculates on what it adopted (prompt
lookup needs only the prompt ids the handoff brings) and produces the colocated non-speculative tokens; its stats
report a mean acceptance length above 1 (verify rows ran and accepted drafts), which the ingress exports per
replica for `k3serve status`, its counters go out by vLLM's names, and it ends holding nothing. The model is
tests/conftest.py's echo checkpoint, which repeats itself enough for prompt lookup to be accepted.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from prometheus_client import CollectorRegistry, generate_latest

from k3serve.cluster.api.app import build_app
from k3serve.cluster.metrics import IngressMetrics
from k3serve.cluster.status import _parse_metrics  # what `k3serve status` reads
from k3serve.cluster.router import DisaggregatedRouter
from k3serve.decode.worker import DecodeWorker
from k3serve.engine.async_engine import AsyncEngine
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer
from k3serve.prefill.worker import PrefillWorker

from _api_harness import EngineAdapter

pytestmark = pytest.mark.timeout(180)
ENGINE_ARGS = dict(block_size=16, max_model_len=512, cache_memory_bytes=64 << 20)
SPEC = {"method": "ngram", "num_speculative_tokens": 4}
PROMPTS = ["the cat sat on the mat", "speculative decoding", "a b c d e f g"]
PROMPT_IDS = [[21, 22, 23, 24], [301, 7, 301, 7, 301], list(range(40, 90))]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _complete(engine: AsyncEngine, bodies: list[dict]) -> list[dict]:
    client = EngineAdapter(engine)
    app = build_app(client)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as http:
        answers = []
        for body in bodies:
            response = await http.post("/v1/completions", json=body | {"model": client.model_name})
            assert response.status_code == 200, response.text
            answers += response.json()["choices"]
        return answers


@pytest.mark.anyio
@pytest.mark.parametrize("k", [1, 4, 8])
async def test_openai_completions_are_the_same_with_and_without_speculation(echo_checkpoint: Path, k: int) -> None:
    plain = AsyncEngine(EngineArgs(model=str(echo_checkpoint), **ENGINE_ARGS))
    spec = AsyncEngine(EngineArgs(model=str(echo_checkpoint), speculative_config=SPEC | {"num_speculative_tokens": k},
                                  **ENGINE_ARGS))
    try:
        bodies = [{"model": "x", "prompt": p, "max_tokens": 32, "temperature": 0} for p in PROMPTS]
        want = await _complete(plain, bodies)
        stop = want[0]["text"][6:9]  # a stop string well inside the output
        bodies.append({"model": "x", "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0, "stop": [stop]})
        bodies.append({"model": "x", "prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0, "n": 2,
                       "logprobs": 2})
        want += await _complete(plain, bodies[-2:])
        got = await _complete(spec, bodies)
        assert [(c["text"], c["finish_reason"]) for c in got] == [(c["text"], c["finish_reason"]) for c in want]
        assert want[-3]["finish_reason"] == "stop" and len(got) == len(bodies) + 1  # n = 2: two choices
        for g, w in zip(got[-2:], want[-2:]):  # logprobs of accepted tokens, each from its own row
            assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
            assert g["logprobs"]["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-4)
        stats = spec.engine.spec_stats
        assert stats.num_accepted_tokens > 0, "no draft was accepted through the API"
    finally:
        plain.shutdown()
        spec.shutdown()
    for engine in (plain, spec):
        pools = engine.engine.scheduler
        assert (pools.block_pool.num_used, pools.state_pool.num_used) == (0, 0)


def test_the_decode_engine_speculates_after_the_handoff(echo_checkpoint: Path) -> None:
    reference = LLM(str(echo_checkpoint), **ENGINE_ARGS).generate(
        PROMPT_IDS, SamplingParams(temperature=0.0, max_tokens=32))
    prefill = PrefillWorker(EngineArgs(model=str(echo_checkpoint), **ENGINE_ARGS), transfer="local", name="prefill-0")
    decode = DecodeWorker(EngineArgs(model=str(echo_checkpoint), speculative_config=SPEC, **ENGINE_ARGS),
                          transfer="local", name="decode-0")
    checkpoint = str(echo_checkpoint)
    registry = CollectorRegistry()
    metrics = IngressMetrics(registry, model_name="echo", pools=[("prefill", "prefill-0"), ("decode", "decode-0")])

    async def run() -> tuple[list[list[int]], object]:
        router = DisaggregatedRouter([prefill], [decode], Tokenizer.from_dir(checkpoint), "echo",
                                     ENGINE_ARGS["max_model_len"], ModelConfig.from_dir(checkpoint).vocab_size,
                                     metrics=metrics)
        try:
            async def tokens(i: int, prompt: list[int]) -> list[int]:
                params = SamplingParams(temperature=0.0, max_tokens=32)
                return [t async for d in router.generate(GenerateRequest(f"r{i}", prompt, params))
                        for t in d.new_token_ids]
            outs = await asyncio.gather(*(tokens(i, p) for i, p in enumerate(PROMPT_IDS)))
            metrics_text = await decode.metrics_text()  # what the ingress re-exports, by vLLM's names
            for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
                         'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="echo",position="0"}',
                         "k3serve:spec_decode_acceptance_length_bucket"):
                assert name.split("{")[0] in metrics_text, name
            for _ in range(200):
                stats = await decode.stats()
                if (stats.num_running, stats.num_reserved, stats.block_usage, stats.slot_usage) == (0, 0, 0.0, 0.0):
                    await router.check_health()  # a stats refresh: the ingress's gauges
                    return outs, stats
                await asyncio.sleep(0.05)
            raise AssertionError(f"decode pool not idle: {stats}")
        finally:
            await router.close()

    try:
        outs, stats = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        decode.shutdown()
        prefill.shutdown()
    assert outs == [o.outputs[0].token_ids for o in reference]
    assert stats.spec_mean_acceptance_length is not None and stats.spec_mean_acceptance_length > 1.0
    replicas, _ = _parse_metrics(generate_latest(registry).decode())
    (shown,) = [r for r in replicas if r.pool == "decode"]
    assert shown.acceptance_length == stats.spec_mean_acceptance_length, shown
    assert shown.settings.get("speculative_config") == "ngram:4", shown
