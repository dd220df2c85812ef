"""Autoscaling a local deployment (cluster/autoscaler.py over cluster/router.py; `--launcher local`: adding a
replica builds another in-process worker, removing one drains it through the router, then shuts it down).
Real workers on the tiny model, transfer "local", the autoscaler ticking in the test's event loop.

Spec:
- a load ramp of running sequences grows the decode pool from 1 to 2 replicas, the new one takes requests,
  and idle shrinks it back to 1; every request during both is exactly the colocated engine's greedy output;
- a prompt-heavy ramp grows the prefill pool from 1 to 2 likewise, and idle shrinks it back;
- a decode replica removed while requests stream on it is routed nothing new, and each of its streams
  finishes identically before it stops;
- nothing leaks: a removed replica's engine thread ends, the remaining engines come back to no request,
  block or slot, and /metrics shows desired vs current replicas and the signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import pytest

from k3serve.cluster.config import ServeConfig
from k3serve.cluster.serve import Deployment, start_deployment
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

ENGINE = dict(block_size=16, max_model_len=512, cache_memory_bytes=64 << 20)
PROMPTS = [[(i * 17 + j * 7) % 450 + 20 for j in range(24 + i)] for i in range(16)]
LONG_PROMPTS = [[(i * 13 + j * 5) % 450 + 20 for j in range(300 + i)] for i in range(16)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TICK_S = 0.05


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), **ENGINE)


def _reference(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _engine_threads() -> int:
    return sum(t.name == "k3serve-engine" for t in threading.enumerate())


@contextlib.asynccontextmanager
async def _deployment(checkpoint: Path, **autoscaling):
    """A local deployment with these autoscaling fields, its autoscaler ticking every TICK_S."""
    threads_before = _engine_threads()
    dep = start_deployment(ServeConfig(model=str(checkpoint), launcher="local", transfer="local", **ENGINE,
                                       **autoscaling))
    dep.autoscaler.interval_s = TICK_S
    dep.autoscaler.start()
    try:
        yield dep
    finally:
        await dep.autoscaler.close()
        await dep.client.close()
        dep.shutdown()
    assert _engine_threads() == threads_before  # every replica, started first or added, was stopped


async def _tokens(dep: Deployment, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for delta in dep.client.generate(GenerateRequest(rid, prompt, params)):
        tokens += delta.new_token_ids
    return tokens


async def _until(condition, timeout_s: float, what: str) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s: {what}")


async def _idle(dep: Deployment) -> None:
    """Every replica still in the router holds no request, reservation, block or slot."""
    for replica in dep.client.prefill + dep.client.decode:
        for _ in range(200):
            s = await replica.stats()
            if (s.num_running, s.num_waiting, s.num_reserved, s.block_usage, s.slot_usage) == (0, 0, 0, 0.0, 0.0):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"{replica.name} not idle: {s}")


def _names(replicas) -> list[str]:
    return [r.name for r in replicas]


class _PoolSizes:
    """Samples a pool's replica list (the router's, live) until stopped: every size and name seen."""

    def __init__(self, pool: list) -> None:
        self.pool, self.seen, self.names = pool, [len(pool)], set(_names(pool))
        self._task = asyncio.get_running_loop().create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            self.seen.append(len(self.pool))
            self.names |= set(_names(self.pool))
            await asyncio.sleep(0.01)

    def stop(self) -> None:
        self._task.cancel()


async def test_a_decode_ramp_grows_the_pool_to_two_and_idle_shrinks_it_back_every_request_exact(
    tiny_checkpoint: Path, llm: LLM
) -> None:
    async with _deployment(tiny_checkpoint, decode_max_replicas=2, decode_autoscale_target=2,
                           decode_scale_up_delay_seconds=0.2, decode_scale_down_delay_seconds=1.0) as deployment:
        router = deployment.client
        first = [asyncio.create_task(_tokens(deployment, f"ramp-{i}", p, GREEDY)) for i, p in enumerate(PROMPTS[:8])]
        await _until(lambda: len(router.decode) == 2, 30, "a second decode replica joined")
        assert _names(router.decode) == ["decode-0", "decode-1"]
        busiest_new = 0

        async def watch_new_replica() -> None:
            nonlocal busiest_new
            while True:
                busiest_new = max(busiest_new, (await router.decode[1].stats()).num_running)
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch_new_replica())
        second = [asyncio.create_task(_tokens(deployment, f"more-{i}", p, GREEDY)) for i, p in enumerate(PROMPTS[8:])]
        got = await asyncio.gather(*first, *second)
        watcher.cancel()
        assert got == _reference(llm, PROMPTS, GREEDY)
        assert busiest_new > 0  # the added replica served requests
        assert deployment.autoscaler.decisions["decode"].desired == 2
        await _until(lambda: len(router.decode) == 1, 30, "idle shrank the decode pool back to one")
        assert _names(router.decode) == ["decode-0"]
        assert await _tokens(deployment, "after", PROMPTS[0], GREEDY) == _reference(llm, PROMPTS[:1], GREEDY)[0]
        await _idle(deployment)
        text = deployment.metrics.render().decode()
        assert 'k3serve:desired_replicas{model_name="' in text and 'pool="decode"} 1.0' in text
        assert 'k3serve:current_replicas{model_name="' in text
        assert 'pool="decode",signal="running_sequences"}' in text
        assert 'replica="decode-1"' not in text  # the removed replica's series are gone


async def test_a_prompt_heavy_ramp_grows_the_prefill_pool_to_two_and_idle_shrinks_it_back(
    tiny_checkpoint: Path, llm: LLM
) -> None:
    async with _deployment(tiny_checkpoint, prefill_max_replicas=2, prefill_autoscale_target=300,
                           prefill_scale_up_delay_seconds=0.1, prefill_scale_down_delay_seconds=2.0) as deployment:
        router = deployment.client
        sizes = _PoolSizes(router.prefill)
        got: list[list[int]] = []
        rounds = 0
        while max(sizes.seen) < 2 and rounds < 20:  # waves of long prompts until the pool grows
            got += await asyncio.gather(*(_tokens(deployment, f"wave{rounds}-{i}", p, SHORT)
                                          for i, p in enumerate(LONG_PROMPTS)))
            rounds += 1
        got += await asyncio.gather(*(_tokens(deployment, f"after-{i}", p, SHORT) for i, p in enumerate(LONG_PROMPTS)))
        assert max(sizes.seen) == 2 and "prefill-1" in sizes.names
        assert got == _reference(llm, LONG_PROMPTS, SHORT) * (rounds + 1)
        await _until(lambda: len(router.prefill) == 1, 30, "idle shrank the prefill pool back to one")
        assert _names(router.prefill) == ["prefill-0"]
        sizes.stop()
        await _idle(deployment)


async def test_a_decode_replica_removed_while_requests_stream_finishes_each_identically(
    tiny_checkpoint: Path, llm: LLM
) -> None:
    """8 streams over two replicas; the pool is sized for 64 a replica, so one replica drains while they run."""
    async with _deployment(tiny_checkpoint, decode_replicas=2, decode_min_replicas=1, decode_max_replicas=2,
                           decode_autoscale_target=64,
                           decode_scale_down_delay_seconds=1.0) as deployment:
        router = deployment.client
        long = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
        requests = [asyncio.create_task(_tokens(deployment, f"stream-{i}", p, long)) for i, p in enumerate(PROMPTS[:8])]
        await _until(lambda: router.is_draining("decode-1"), 10, "decode-1 chosen for removal")
        at_drain = await router.decode[1].stats()
        late = await _tokens(deployment, "late", PROMPTS[9], GREEDY)  # served while decode-1 drains
        got = await asyncio.gather(*requests)
        assert at_drain.num_running + at_drain.num_reserved > 0  # it was removed while streaming
        assert got == _reference(llm, PROMPTS[:8], long)
        assert late == _reference(llm, PROMPTS[9:10], GREEDY)[0]
        await _until(lambda: _names(router.decode) == ["decode-0"], 10, "decode-1 stopped once its streams ended")
        await _idle(deployment)


async def test_a_ttft_over_its_slo_grows_the_prefill_pool_and_back_under_it_shrinks_it(
    tiny_checkpoint: Path, llm: LLM
) -> None:
    """The TTFTs the OpenAI layer records into the ingress's histogram (here recorded directly: 3 s against a
    1 s SLO) grow the pool; once they are out of the window, it shrinks back. Requests served meanwhile."""
    async with _deployment(tiny_checkpoint, prefill_max_replicas=2, prefill_autoscale_signal="ttft_p90_seconds",
                           prefill_autoscale_target=1.0, prefill_scale_up_delay_seconds=0.1,
                           prefill_scale_down_delay_seconds=0.3) as deployment:
        router, metrics = deployment.client, deployment.metrics
        deployment.autoscaler.latency["prefill"].window_s = 1.0
        ttft = metrics.ttft.labels(*metrics.vllm_labels)
        await asyncio.sleep(2 * TICK_S)  # the window's first sample: what came before it is not in the window
        for _ in range(20):
            ttft.observe(3.0)
        await _until(lambda: len(router.prefill) == 2, 30, "a TTFT p90 over the SLO added a prefill replica")
        assert await _tokens(deployment, "served", PROMPTS[0], SHORT) == _reference(llm, PROMPTS[:1], SHORT)[0]
        await _until(lambda: len(router.prefill) == 1, 30, "the slow TTFTs left the window: back to one replica")
        text = metrics.render().decode()
        assert 'pool="prefill",signal="ttft_p90_seconds"} 0.0' in text
        await _idle(deployment)
