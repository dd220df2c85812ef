"""A prefix-cache hit through the disaggregated ingress: the prefill worker's engine knows it, and the router puts
it on the request's deltas (PrefillResult.num_cached_tokens), so the usage's cached_tokens and the ingress's
vllm:prefix_cache_* counters see it (the real router over in-process workers; test_admission_queue.py's harness)."""

from __future__ import annotations

import pytest

from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest

from test_admission_queue import serving, workers  # noqa: F401 (workers: a fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

PROMPT = [(5 * j) % 450 + 20 for j in range(40)]  # 2 full blocks of 16 before its last token
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


async def cached_tokens(router, rid: str, params: SamplingParams = PARAMS) -> list[int]:
    return [delta.num_cached_tokens async for delta in router.generate(GenerateRequest(rid, PROMPT, params))]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_the_prefill_workers_cache_hit_reaches_every_delta(workers, tiny_checkpoint):  # noqa: F811
    async with serving(workers, tiny_checkpoint) as router:
        assert set(await cached_tokens(router, "first")) == {0}
        assert set(await cached_tokens(router, "again")) == {32}  # handed off, decoded: still the prefill's hit
        one = SamplingParams(temperature=0.0, max_tokens=1)  # ends at its first token on the prefill worker
        assert await cached_tokens(router, "one", one) == [32]
