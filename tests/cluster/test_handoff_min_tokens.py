"""min_tokens across the disaggregated handoff (real router, in-process 1P1D workers of test_decode_feed): the prefill
engine samples only the first token, so it runs the request's params with max_tokens 1 and min_tokens at most 1 (EOS
still banned for that token when the request asks for any); the decode engine keeps the request's own min_tokens.
It was a ValueError (min_tokens > max_tokens) for every request with min_tokens > 1.

EOS is pushed to the top of every step's logits (logit_bias +100), so the request ends at the first step min_tokens
lets it: an EOS sampled before min_tokens, on either engine, would end it short."""

from __future__ import annotations

import asyncio

import pytest

from k3serve.cluster.router import DisaggregatedRouter
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer

from test_decode_feed import ENGINE_ARGS, workers  # noqa: F401  (workers: the in-process 1P1D fixture)

pytestmark = pytest.mark.timeout(120)


def test_min_tokens_above_one_is_served_and_held(workers, tiny_checkpoint):
    prefill, decode = workers
    vocab = ModelConfig.from_dir(tiny_checkpoint).vocab_size
    eos = Tokenizer.from_dir(tiny_checkpoint).eos_token_id
    params = SamplingParams(temperature=0.0, min_tokens=5, max_tokens=8, logit_bias={eos: 100.0})

    async def run():
        router = DisaggregatedRouter([prefill], [decode], Tokenizer.from_dir(tiny_checkpoint), "k3-tiny",
                                     ENGINE_ARGS["max_model_len"], vocab)
        try:
            return [d async for d in router.generate(GenerateRequest("min-tokens", [21, 22, 23, 24], params))]
        finally:
            await router.close()

    deltas = asyncio.run(asyncio.wait_for(run(), 60))
    tokens = [t for d in deltas for t in d.new_token_ids]
    assert len(tokens) >= 5 and deltas[-1].finish_reason in ("stop", "length")
    assert eos not in tokens[:5] and deltas[-1].finish_reason == "stop"  # held for 5 tokens, then the biased EOS
    assert tokens[5:] == [eos] and deltas[-1].finish_reason == "stop", tokens  # EOS as soon as min_tokens allows
