"""OpenAI's `usage.prompt_tokens_details.cached_tokens` for a prompt served from the host offload tier (colocated, the
real API over the real engine): the prefix evicted from the device still counts as cached, and the text is the text
a server with no cache gives."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from k3serve.cluster.api import build_app
from k3serve.cluster.metrics import IngressMetrics
from k3serve.engine.async_engine import AsyncEngine

from _api_harness import ENGINE_ARGS, EngineAdapter, pool_usage

pytestmark = pytest.mark.anyio
FIRST = list(range(20, 90))  # its unit: 64 tokens (block_size 16)
SECOND = FIRST + list(range(200, 230))
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


async def completion(engine: AsyncEngine, prompt: list[int]) -> dict:
    client = EngineAdapter(engine)
    app = build_app(client, IngressMetrics(CollectorRegistry(), model_name=client.model_name, pools=[("decode", "0")]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as http:
        r = await http.post("/v1/completions", json={"prompt": prompt, **GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


async def test_cached_tokens_count_a_host_tier_hit(tiny_checkpoint: Path):
    offloading = AsyncEngine(model=str(tiny_checkpoint), kv_offload="host", **ENGINE_ARGS)
    plain = AsyncEngine(model=str(tiny_checkpoint), enable_prefix_caching=False, **ENGINE_ARGS)
    try:
        await completion(offloading, FIRST)
        await offloading.call(lambda e: e.scheduler.prefix_cache.clear())  # only the host tier holds the unit
        got, want = await completion(offloading, SECOND), await completion(plain, SECOND)
        assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
        assert want["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert await offloading.call(lambda e: e.offload.counts["host"].hits) == 64
    finally:
        for engine in (offloading, plain):
            engine.shutdown()
            assert pool_usage(engine) == (0, 0)
