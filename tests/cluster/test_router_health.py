"""What the disaggregated ingress reports about its replicas (issue 27), over real in-process workers (the tiny
model, transfer "local") and a real router, stats refreshed by the test (/health refreshes them):

- A decode replica that dies has its gauges dropped and marked stale at the first refresh that fails, and
  replicas_healthy stops counting it: no phantom `num_requests_running` of its last value.
- A decode pool whose every KDA slot is held by reservations that do not move (Reserve calls on the control plane,
  never handed off) cannot admit work: /health answers 503 "degraded" naming it (`k3serve status` shows why),
  replicas_healthy counts 0 decode replicas; once the reservations go, both are green again.
- A pool full of requests that are running is busy, not degraded: /health stays 200.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from k3serve.cluster.api import build_app
from k3serve.cluster.metrics import IngressMetrics
from k3serve.cluster.router import DisaggregatedRouter, PoolDegradedError, ReplicaUnavailableError
from k3serve.cluster.status import print_status
from k3serve.decode.worker import DecodeWorker
from k3serve.engine.config import EngineArgs
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer
from k3serve.prefill.worker import PrefillWorker

from _api_harness import serve_ingress
from test_api import assert_error
from _faulty_replicas import wait_decode_idle
from test_decode_feed import ENGINE_ARGS, PROMPTS

pytestmark = pytest.mark.anyio

MODEL = "k3-tiny"
STALL_S = 0.5
HOLD = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)  # runs for seconds unless closed


@pytest.fixture(scope="module")
def prefill(tiny_checkpoint: Path):
    worker = PrefillWorker(EngineArgs(model=str(tiny_checkpoint), **ENGINE_ARGS), transfer="local", name="prefill-0")
    yield worker
    worker.shutdown()


def two_slot_decode(tiny_checkpoint: Path, name: str) -> DecodeWorker:
    args = EngineArgs(model=str(tiny_checkpoint), **ENGINE_ARGS, max_num_seqs=2, enable_prefix_caching=False)
    assert args.kda_slots == 2
    return DecodeWorker(args, transfer="local", name=name)


@pytest.fixture(scope="module")
def decode(tiny_checkpoint: Path):
    worker = two_slot_decode(tiny_checkpoint, "decode-0")
    yield worker
    worker.shutdown()


@contextlib.asynccontextmanager
async def routing(prefill, decode, tiny_checkpoint: Path):
    """A router over the workers with admission_stall_seconds STALL_S, no background refresh, and its app."""
    metrics = IngressMetrics(CollectorRegistry(), model_name=MODEL)
    router = DisaggregatedRouter([prefill], [decode], Tokenizer.from_dir(tiny_checkpoint), MODEL,
                                 ENGINE_ARGS["max_model_len"], ModelConfig.from_dir(tiny_checkpoint).vocab_size,
                                 metrics, refresh_seconds=3600, admission_stall_seconds=STALL_S)
    app = build_app(router, metrics)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as http:
            http.app = app
            yield router, http
    finally:
        await router.close()


def gauge(router: DisaggregatedRouter, name: str, **labels: str) -> float | None:
    """A series' value as /metrics exports it; None when it is not exported."""
    return router.metrics.registry.get_sample_value(f"k3serve:{name}", {"model_name": MODEL, **labels})


async def hold(router: DisaggregatedRouter, rid: str, prompt: list[int]):
    """A request admitted and decoding, until its stream is closed."""
    stream = router.generate(GenerateRequest(rid, prompt, HOLD))
    await stream.__anext__()
    return stream


async def test_a_dead_decode_replica_has_its_gauges_dropped_and_marked_stale_at_once(prefill, tiny_checkpoint):
    doomed = two_slot_decode(tiny_checkpoint, "decode-doomed")
    replica = {"pool": "decode", "replica": "decode-doomed"}
    async with routing(prefill, doomed, tiny_checkpoint) as (router, http):
        stream = await hold(router, "in-flight", PROMPTS[0])
        try:
            await _check_the_death_is_seen(router, http, doomed, replica)
        finally:
            doomed.shutdown()
            with contextlib.suppress(Exception):  # its replica is gone
                await asyncio.wait_for(stream.aclose(), 10)


async def _check_the_death_is_seen(router: DisaggregatedRouter, http: httpx.AsyncClient, doomed: DecodeWorker,
                                   replica: dict[str, str]) -> None:
    await router.check_health()
    assert gauge(router, "num_requests_running", **replica) == 1
    assert gauge(router, "kda_slot_usage_ratio", **replica) == 0.5
    assert gauge(router, "replica_stats_stale", **replica) == 0
    assert gauge(router, "replicas_healthy", pool="decode") == 1

    doomed.shutdown()  # the replica dies with its request in flight
    with pytest.raises(ReplicaUnavailableError, match="no healthy decode replica"):
        await router.check_health()  # the first refresh after its death
    for series in ("num_requests_running", "num_requests_waiting", "kv_block_usage_ratio", "kda_slot_usage_ratio"):
        assert gauge(router, series, **replica) is None, series  # dropped, not left at their last values
    assert gauge(router, "replica_stats_stale", **replica) == 1
    assert gauge(router, "replicas_healthy", pool="decode") == 0
    assert gauge(router, "replicas_healthy", pool="prefill") == 1
    marks = ('k3serve:replica_stats_stale{model_name="k3-tiny",pool="decode",replica="decode-doomed"} 1.0',
             'k3serve:replica_healthy{model_name="k3-tiny",pool="decode",replica="decode-doomed"} 0.0')
    text = router.metrics.render().decode()
    assert all(mark in text for mark in marks)  # what is left of it says it is gone, not what it last ran
    for mark in marks:
        text = text.replace(mark, "")
    assert 'replica="decode-doomed"' not in text
    assert_error(await http.get("/health"), 503, message="no healthy decode replica")


async def test_a_pool_held_by_unmoving_reservations_is_degraded_until_they_go(prefill, decode, tiny_checkpoint,
                                                                              capsys):
    async with routing(prefill, decode, tiny_checkpoint) as (router, http):
        assert (await http.get("/health")).status_code == 200
        squatters = ["squatter-0", "squatter-1"]
        for rid in squatters:  # what a Reserve call on the control plane does (decode.reserve is its handler)
            await asyncio.to_thread(decode.reserve, rid, 16, decode.lease_seconds, "127.0.0.1")
        try:
            await _check_degraded_until_freed(router, http, decode, squatters, capsys)
        finally:
            for rid in squatters:
                with contextlib.suppress(Exception):  # freed already
                    await asyncio.to_thread(decode.abort, rid, "the test frees its reservations")
    await wait_decode_idle(decode)


async def _check_degraded_until_freed(router: DisaggregatedRouter, http: httpx.AsyncClient, decode: DecodeWorker,
                                      squatters: list[str], capsys) -> None:
    assert (await http.get("/health")).status_code == 200  # full, but not for long yet
    await asyncio.sleep(STALL_S + 0.1)
    assert_error(await http.get("/health"), 503,
                 message="degraded: no decode replica can admit a request: decode-0: no room for")
    with pytest.raises(PoolDegradedError, match="held by 2 reservations that have not moved"):
        await router.check_health()
    assert gauge(router, "replicas_healthy", pool="decode") == 0  # it answers, but cannot admit
    assert gauge(router, "replicas_healthy", pool="prefill") == 1
    assert gauge(router, "replica_stats_stale", pool="decode", replica="decode-0") == 0  # its stats are fresh
    async with serve_ingress(http.app) as port:  # `k3serve status` says why
        assert await asyncio.to_thread(print_status, f"http://127.0.0.1:{port}") == 1
    shown = capsys.readouterr().out
    assert "unhealthy (/health 503: unhealthy: degraded: no decode replica can admit a request: decode-0" in shown, shown

    for rid in squatters:
        await asyncio.to_thread(decode.abort, rid, "the test frees its reservations")
    assert (await http.get("/health")).status_code == 200
    assert gauge(router, "replicas_healthy", pool="decode") == 1


async def test_a_pool_full_of_running_requests_is_busy_not_degraded(prefill, decode, tiny_checkpoint):
    async with routing(prefill, decode, tiny_checkpoint) as (router, http):
        streams = [await hold(router, f"runner-{i}", PROMPTS[i]) for i in range(2)]
        try:
            await router.check_health()
            stats = await decode.stats()
            assert stats.num_free_slots == 0 and stats.num_running == 2  # no room: both slots decode
            await asyncio.sleep(STALL_S + 0.1)
            assert (await http.get("/health")).status_code == 200
            assert gauge(router, "replicas_healthy", pool="decode") == 1
        finally:
            for stream in streams:
                await stream.aclose()
    await wait_decode_idle(decode)
