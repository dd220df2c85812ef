"""Autoscaling a Ray deployment (cluster/serve.py `_start_ray`'s launcher: a new replica is a new actor, up
before it joins routing; a removed one drains, then its actor is killed). One decode ramp on a Ray cluster
the deployment joins: the pool grows from 1 to 2 replicas under load, every request is exactly the
colocated engine's greedy output, idle shrinks it back to 1, and the removed replica's actor is gone (its
CPU free again); shut down, the deployment leaves every CPU free.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import pytest
ray = pytest.importorskip("ray")  # a test extra; the GPU machine has none

from k3serve.cluster import serve
from k3serve.cluster.config import ServeConfig
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.transfer.backends import available_backends

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

ENGINE = dict(block_size=16, max_model_len=256, cache_memory_bytes=16 << 20)
CPUS = 3  # prefill-0, decode-0, decode-1
PROMPTS = [[(i * 17 + j * 7) % 450 + 20 for j in range(24 + i)] for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)  # runs while the new actor starts


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def ray_cluster():
    # Ray's socket paths must stay short, so its session folder sits in /tmp rather than in pytest's tmp_path.
    temp_dir = tempfile.mkdtemp(prefix="k3as-", dir="/tmp")
    ray.init(num_cpus=CPUS, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


async def _until(condition, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)


async def _tokens(router, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t async for delta in router.generate(GenerateRequest(rid, prompt, params)) for t in delta.new_token_ids]


@pytest.mark.skipif(not available_backends()["nixl"], reason="the NIXL backend does not import on this host")
async def test_a_decode_ramp_adds_a_ray_actor_and_idle_removes_it(ray_cluster, tiny_checkpoint: Path) -> None:
    llm = LLM(str(tiny_checkpoint), **ENGINE)
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], LONG) + llm.generate(PROMPTS[4:], GREEDY)]
    deployment = serve.start_deployment(ServeConfig(
        model=str(tiny_checkpoint), launcher="ray", transfer="nixl", **ENGINE, decode_max_replicas=2,
        decode_autoscale_target=2, decode_scale_up_delay_seconds=0.2, decode_scale_down_delay_seconds=1.0))
    router = deployment.client
    try:
        deployment.autoscaler.interval_s = 0.05
        deployment.autoscaler.start()
        requests = [asyncio.create_task(_tokens(router, f"ramp-{i}", p, LONG)) for i, p in enumerate(PROMPTS[:4])]
        await _until(lambda: len(router.decode) == 2, 120, "a second decode actor joined")
        assert [r.name for r in router.decode] == ["decode-0", "decode-1"]
        requests += [asyncio.create_task(_tokens(router, f"more-{i}", p, GREEDY)) for i, p in enumerate(PROMPTS[4:], 4)]
        assert await asyncio.gather(*requests) == reference
        await _until(lambda: [r.name for r in router.decode] == ["decode-0"], 30, "idle removed decode-1")
        await _until(lambda: ray.available_resources().get("CPU", 0) == CPUS - 2, 10, "decode-1's CPU freed")
        await deployment.autoscaler.close()
        await router.close()
    finally:
        deployment.shutdown()
    await _until(lambda: ray.available_resources().get("CPU", 0) == CPUS, 10, "every CPU freed")
