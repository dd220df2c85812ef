"""The disaggregated ingress's admission queue (`cluster/admission.py`, in `cluster/router.py`): when
no decode replica has room, a request waits, in arrival order, instead of failing with 503, as
colocated mode queues it. Real in-process workers (one prefill, one decode replica with a single
KDA slot: one request at a time; transfer "local", the tiny model), a real router.

- A burst of 5 requests through the one-slot pool: all complete, admitted in arrival order, each
  with the tokens it gets alone (greedy: the offline engine's); while the first runs the other four
  wait (the ingress gauge says 4) and the gauge ends at 0; every admission's wait is a queue time.
  Each request that ends admits the next at once (no stats refresh runs meanwhile).
- Room freed by another ingress is noticed at the next stats refresh.
- A large prompt at the head, waiting for MLA blocks, is not overtaken by a small one that would fit
  (a stream of small ones would starve it): the small one waits behind it, through several wakes.
- With max_queued_requests waiting, the next request gets 503 at once; the waiting one is served.
- A request that waits longer than queue_timeout_seconds gets 503 saying so, and leaves the queue.
- A waiting request that is cancelled leaves the queue at once, holding nothing; the one behind it
  is admitted when room opens.
- A prompt of max_model_len tokens, which no replica could ever hold, fails at once (400), full
  pool and queue or not.
- ServeConfig validates the bounds (colocated mode refuses them) and defaults the queue to 8 rounds
  of the decode pool; the router `k3serve serve` builds gets them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from k3serve.cluster.api.errors import EngineOverloadedError
from k3serve.cluster.config import ServeConfig
from k3serve.cluster.metrics import IngressMetrics
from k3serve.cluster.router import DisaggregatedRouter
from k3serve.cluster.serve import _router
from k3serve.decode.worker import DecodeWorker
from k3serve.engine.async_engine import GenerateRequest
from k3serve.engine.config import EngineArgs
from k3serve.engine.memory import cache_sizes
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer
from k3serve.prefill.worker import PrefillWorker

from test_decode_feed import ENGINE_ARGS, GREEDY, PROMPTS, _tokens, _wait_decode_idle, reference  # noqa: F401

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

BURST = 5
HOLD = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)  # runs for seconds unless closed
MODEL = "k3-tiny"


class RecordingDecode:
    """A decode worker that records the request ids it admitted, in order; the rest passes through."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker, self.name = worker, worker.name
        self.admitted: list[str] = []

    async def admit(self, request_id: str, *args):
        reservation = await self.worker.admit(request_id, *args)
        self.admitted.append(request_id)
        return reservation

    def __getattr__(self, name: str):
        return getattr(self.worker, name)


@pytest.fixture(scope="module")
def workers(tiny_checkpoint: Path):
    prefill = PrefillWorker(EngineArgs(model=str(tiny_checkpoint), **ENGINE_ARGS), transfer="local", name="prefill-0")
    one_slot = EngineArgs(model=str(tiny_checkpoint), **ENGINE_ARGS, max_num_seqs=1, enable_prefix_caching=False)
    assert one_slot.kda_slots == 1
    decode = DecodeWorker(one_slot, transfer="local", name="decode-0")
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


@pytest.fixture(scope="module")
def two_slot_decode(tiny_checkpoint: Path):
    """A decode replica with two KDA slots and 36 MLA blocks of 16 tokens: while a 250-token request
    runs there (16 blocks, up to 32 as it grows), a 20-token prompt fits (2 blocks), a 400-token one (25) not."""
    sizes = cache_sizes(ModelConfig.from_dir(tiny_checkpoint), 1, torch.float32)
    cache_bytes = 2 * sizes.kda_bytes_per_slot + 36 * ENGINE_ARGS["block_size"] * sizes.mla_bytes_per_token
    args = EngineArgs(model=str(tiny_checkpoint), **{**ENGINE_ARGS, "cache_memory_bytes": cache_bytes},
                      max_num_seqs=2, enable_prefix_caching=False)
    worker = DecodeWorker(args, transfer="local", name="decode-1")
    yield worker
    worker.shutdown()


@contextlib.asynccontextmanager
async def serving(workers, tiny_checkpoint: Path, **router_kwargs):
    """A router over the workers (queue bounds, refresh period); its decode replica records admissions.
    Afterwards the decode pool must be idle: nothing leaked."""
    prefill, decode = workers
    metrics = IngressMetrics(CollectorRegistry(), model_name=MODEL)
    router = DisaggregatedRouter([prefill], [RecordingDecode(decode)], Tokenizer.from_dir(tiny_checkpoint), MODEL,
                                 ENGINE_ARGS["max_model_len"], metrics, **router_kwargs)
    try:
        yield router
    finally:
        await router.close()
    await _wait_decode_idle(decode)


def queued(router: DisaggregatedRouter) -> float:
    """The ingress queue gauge, as /metrics exports it."""
    return router.metrics.registry.get_sample_value(
        "k3serve:num_requests_waiting", {"model_name": MODEL, "pool": "ingress", "replica": "router"})


async def until(predicate, what: str, deadline_s: float = 5.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def occupy(router: DisaggregatedRouter):
    """A request holding the decode pool's only slot (admitted and decoding) until its stream is closed."""
    stream = router.generate(GenerateRequest("occupant", PROMPTS[0], HOLD))
    await stream.__anext__()
    return stream


async def test_a_burst_beyond_the_decode_slots_waits_and_is_served_in_arrival_order(
    workers, tiny_checkpoint, reference
) -> None:
    async with serving(workers, tiny_checkpoint, max_queued_requests=8, queue_timeout_seconds=30,
                       refresh_seconds=3600) as router:
        rids = [f"burst-{i}" for i in range(BURST)]
        first = router.generate(GenerateRequest(rids[0], PROMPTS[0], GREEDY))
        first_tokens = (await first.__anext__()).new_token_ids  # admitted: the pool is full
        rest = [asyncio.create_task(_tokens(router, rid, p)) for rid, p in zip(rids[1:], PROMPTS[1:BURST])]
        await until(lambda: queued(router) == len(rest), "the rest of the burst to wait at the ingress")
        first_tokens += [t for delta in [d async for d in first] for t in delta.new_token_ids]
        assert [first_tokens, *await asyncio.gather(*rest)] == reference[:BURST]  # none answered 503
        assert router.decode[0].admitted == rids
        assert queued(router) == 0
        count = router.metrics.registry.get_sample_value("k3serve:request_queue_time_seconds_count",
                                                         {"model_name": MODEL})
        assert count == BURST


async def test_room_freed_by_another_ingress_is_noticed_at_the_next_stats_refresh(
    workers, tiny_checkpoint, reference
) -> None:
    async with serving(workers, tiny_checkpoint) as other, \
            serving(workers, tiny_checkpoint, refresh_seconds=0.05, queue_timeout_seconds=5) as router:
        occupant = await occupy(other)
        waiting = asyncio.create_task(_tokens(router, "waits", PROMPTS[1]))
        await until(lambda: router.admission.num_waiting == 1, "a request waiting")
        await occupant.aclose()  # ends on the other ingress: this router is not told
        assert await waiting == reference[1]


async def test_a_large_prompt_at_the_head_is_not_overtaken_by_a_small_one_that_fits(
    workers, two_slot_decode, tiny_checkpoint
) -> None:
    prefill, _ = workers
    async with serving((prefill, two_slot_decode), tiny_checkpoint, refresh_seconds=0.02) as router:
        assert (await two_slot_decode.stats()).num_free_blocks == 36
        occupant = router.generate(GenerateRequest("occupant", [30] * 250, SamplingParams(max_tokens=260, ignore_eos=True)))
        await occupant.__anext__()
        large = asyncio.create_task(_tokens(router, "large", [40] * 400))
        await until(lambda: router.admission.num_waiting == 1, "the large prompt waiting")
        small = asyncio.create_task(_tokens(router, "small", [50] * 20))
        await until(lambda: router.admission.num_waiting == 2, "the small prompt waiting behind it")
        await asyncio.sleep(0.2)  # about 10 wakes by the stats refresh: the head tries, the small one never
        stats = await two_slot_decode.stats()
        assert stats.num_free_slots == 1 and 2 <= stats.num_free_blocks < 25, stats  # room for the small one only
        assert router.admission.num_waiting == 2 and router.decode[0].admitted == ["occupant"]
        await occupant.aclose()
        await asyncio.gather(large, small)
        assert router.decode[0].admitted == ["occupant", "large", "small"]


async def test_beyond_max_queued_requests_the_next_request_gets_503_at_once(
    workers, tiny_checkpoint, reference
) -> None:
    async with serving(workers, tiny_checkpoint, max_queued_requests=1) as router:
        occupant = await occupy(router)
        waiting = asyncio.create_task(_tokens(router, "waits", PROMPTS[1]))
        await until(lambda: router.admission.num_waiting == 1, "one request waiting")
        started = time.monotonic()
        with pytest.raises(EngineOverloadedError, match="1 requests are already waiting"):
            await _tokens(router, "turned-away", PROMPTS[2])
        assert time.monotonic() - started < 0.5
        await occupant.aclose()
        assert await waiting == reference[1]
        assert router.decode[0].admitted == ["occupant", "waits"]


async def test_a_request_that_waits_longer_than_the_queue_timeout_gets_503(workers, tiny_checkpoint) -> None:
    async with serving(workers, tiny_checkpoint, queue_timeout_seconds=0.3) as router:
        occupant = await occupy(router)
        started = time.monotonic()
        with pytest.raises(EngineOverloadedError, match=r"waited 0\.3 s for room on a decode replica"):
            await _tokens(router, "too-late", PROMPTS[1])
        assert 0.3 <= time.monotonic() - started < 2.0
        assert router.admission.num_waiting == 0 and queued(router) == 0
        await occupant.aclose()
        assert router.decode[0].admitted == ["occupant"]


async def test_a_cancelled_waiting_request_leaves_at_once_and_the_next_is_admitted(
    workers, tiny_checkpoint, reference
) -> None:
    async with serving(workers, tiny_checkpoint) as router:
        occupant = await occupy(router)
        cancelled = asyncio.create_task(_tokens(router, "cancelled", PROMPTS[1]))
        behind = asyncio.create_task(_tokens(router, "behind", PROMPTS[2]))
        await until(lambda: router.admission.num_waiting == 2, "two requests waiting")
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert router.admission.num_waiting == 1 and queued(router) == 1
        await occupant.aclose()
        assert await behind == reference[2]
        assert router.decode[0].admitted == ["occupant", "behind"]


async def test_a_prompt_no_replica_could_hold_fails_at_once_even_behind_a_full_pool(
    workers, tiny_checkpoint
) -> None:
    async with serving(workers, tiny_checkpoint) as router:
        occupant = await occupy(router)
        waiting = asyncio.create_task(_tokens(router, "waits", PROMPTS[1]))
        await until(lambda: router.admission.num_waiting == 1, "one request waiting")
        started = time.monotonic()
        with pytest.raises(ValueError, match="max_model_len"):
            await _tokens(router, "too-long", [20] * ENGINE_ARGS["max_model_len"])
        assert time.monotonic() - started < 0.5
        await occupant.aclose()
        await waiting


def test_serve_config_bounds_the_queue_and_the_router_it_builds_gets_them(tiny_checkpoint) -> None:
    assert ServeConfig(decode_replicas=3, max_num_seqs=2).queue_capacity == 8 * 3 * 2
    config = ServeConfig(max_queued_requests=5, queue_timeout_seconds=2.5)
    assert config.queue_capacity == 5
    assert ServeConfig(max_queued_requests=0).queue_capacity == 0  # never wait: 503 at once, as before
    for bad in ({"max_queued_requests": -1}, {"queue_timeout_seconds": 0}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            ServeConfig(**bad)
    with pytest.raises(ValidationError, match="colocated mode queues in its engine's scheduler"):
        ServeConfig(mode="colocated", max_queued_requests=4)
    ServeConfig(mode="colocated")  # the defaults do not count as set

    router, _ = _router(config, [], [], {"model": str(tiny_checkpoint), "served_model_name": MODEL})
    assert (router.admission.max_queued, router.admission.timeout_seconds) == (5, 2.5)
