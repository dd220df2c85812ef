"""The disaggregated ingress's admission queue (`cluster/admission.py`, in `cluster/router.py`): when
no decode replica has room, a request waits, in arrival order, instead of failing with 503, as
colocated mode queues it. Real in-process workers (one prefill, one decode replica with a single
KDA slot: one request at a time; transfer "local", the tiny model), a real router.

- A burst of 5 requests through the one-slot pool: all complete, admitted in arrival order, each
  with the tokens it gets alone (greedy: the offline engine's); while the first runs the other four
  wait (the ingress gauge says 4) and the gauge ends at 0; every admission's wait is a queue time.
  Each request that ends admits the next at once (no stats refresh runs meanwhile).
- Room that opens goes to the earliest request that wants it: a request refused just before the
  room opened (the refusal still on its way back) gets it, not a later arrival that tries
  meanwhile, nor a later request that tried at the same time and whose refusal came back first.
  Without a queue (max_queued_requests=0) that later arrival tries, rather than a 503 untried.
- Room freed by another ingress is noticed at the next stats refresh.
- A large prompt at the head, waiting for MLA blocks, is not overtaken by a small one that would fit
  (a stream of small ones would starve it): the small one waits behind it, through several wakes.
- With max_queued_requests waiting, the next request gets 503 at once (not a queue time: it never
  waited); the waiting one is served.
- A request that waits longer than queue_timeout_seconds gets 503 saying so, and leaves the queue;
  its wait is a queue time (the p95 alert must see the requests that gave up).
- A waiting request that is cancelled leaves the queue at once, holding nothing, its wait a queue
  time; the one behind it is admitted when room opens.
- A prompt of max_model_len tokens, which no replica could ever hold, fails at once (400), full
  pool and queue or not; so does, through the app, a prompt token id or a logit_bias key outside
  the vocabulary, with the engines' own 400, and no engine sees it.
- ServeConfig validates the bounds (colocated mode refuses them) and defaults the queue to 8 rounds
  of the decode pool; the router `k3serve serve` builds gets them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from k3serve.cluster.api import build_app
from k3serve.cluster.errors import EngineOverloadedError
from k3serve.cluster.config import ServeConfig
from k3serve.cluster.metrics import IngressMetrics
from k3serve.cluster.router import DisaggregatedRouter
from k3serve.cluster.serve import _router
from k3serve.decode.worker import DecodeWorker
from k3serve.engine.config import EngineArgs
from k3serve.engine.memory import cache_sizes
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer
from k3serve.prefill.worker import PrefillWorker

from _faulty_replicas import wait_decode_idle
from test_decode_feed import ENGINE_ARGS, GREEDY, PROMPTS, _tokens, reference  # noqa: F401

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

BURST = 5
HOLD = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)  # runs for seconds unless closed
MODEL = "k3-tiny"


class RecordingDecode:
    """A decode worker that records the request ids it admitted, in order; the rest passes through.
    `answered[rid]` is set once the engine decided an admit of `rid` (room or not); with a gate in
    `reply_gates[rid]`, that answer waits for it on its way back to the router (the reply's latency)."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker, self.name = worker, worker.name
        self.admitted: list[str] = []
        self.answered: collections.defaultdict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self.reply_gates: dict[str, asyncio.Event] = {}

    async def admit(self, request_id: str, *args):
        try:
            reservation = await self.worker.admit(request_id, *args)
        finally:
            self.answered[request_id].set()
            if request_id in self.reply_gates:
                await self.reply_gates[request_id].wait()
        self.admitted.append(request_id)
        return reservation

    def __getattr__(self, name: str):
        return getattr(self.worker, name)


class RecordingPrefill:
    """A prefill worker that records the request ids it was asked to prefill; the rest passes through."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker, self.name = worker, worker.name
        self.asked: list[str] = []

    async def prefill(self, request_id: str, *args):
        self.asked.append(request_id)
        return await self.worker.prefill(request_id, *args)

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
    """A router over the workers (queue bounds, refresh period); its replicas record what they were
    asked. Afterwards the decode pool must be idle: nothing leaked."""
    prefill, decode = workers
    metrics = IngressMetrics(CollectorRegistry(), model_name=MODEL)
    router = DisaggregatedRouter([RecordingPrefill(prefill)], [RecordingDecode(decode)], Tokenizer.from_dir(tiny_checkpoint),
                                 MODEL, ENGINE_ARGS["max_model_len"], ModelConfig.from_dir(tiny_checkpoint).vocab_size,
                                 metrics, **router_kwargs)
    try:
        yield router
    finally:
        await router.close()
    await wait_decode_idle(decode)


def queued(router: DisaggregatedRouter) -> float:
    """The ingress queue gauge, as /metrics exports it."""
    return router.metrics.registry.get_sample_value(
        "k3serve:num_requests_waiting", {"model_name": MODEL, "pool": "ingress", "replica": "router"})


def queue_times(router: DisaggregatedRouter) -> tuple[float, float]:
    """(count, sum) of the queue-time histogram, as /metrics exports it."""
    def sample(suffix: str) -> float:
        return router.metrics.registry.get_sample_value(f"vllm:request_queue_time_seconds_{suffix}",
                                                        {"model_name": MODEL, "engine": "0"})
    return sample("count"), sample("sum")


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
        assert queue_times(router)[0] == BURST


async def test_room_that_opens_while_a_refusal_is_on_its_way_goes_to_the_refused_earlier_request(
    workers, tiny_checkpoint
) -> None:
    """A's admit is refused (the pool is full), but the answer is still on its way when the slot
    frees, and B arrives after that: the slot is A's, B must not try beside A's outdated refusal."""
    async with serving(workers, tiny_checkpoint, refresh_seconds=3600) as router:
        decode = router.decode[0]
        occupant = await occupy(router)
        decode.reply_gates["A"] = asyncio.Event()
        a = router.generate(GenerateRequest("A", PROMPTS[1], HOLD))
        a_first = asyncio.ensure_future(a.__anext__())
        await decode.answered["A"].wait()  # refused: the occupant holds the only slot
        await occupant.aclose()  # frees the slot (the engine applies the abort before any later admit)
        b = router.generate(GenerateRequest("B", PROMPTS[2], HOLD))
        b_first = asyncio.ensure_future(b.__anext__())
        await until(lambda: decode.answered["B"].is_set() or router.admission.num_waiting == 1, "B to try or wait")
        decode.reply_gates["A"].set()
        await _first_admitted_is_a_then_b(router, a, a_first, b, b_first)


async def test_of_two_concurrent_first_tries_refused_the_earlier_gets_the_slot_that_opens(
    workers, tiny_checkpoint
) -> None:
    """A and B try at once (nobody waits) and both are refused; the slot frees while both answers are on
    their way, and B's arrives first: the slot is still A's, the earlier arrival."""
    async with serving(workers, tiny_checkpoint, refresh_seconds=3600) as router:
        decode = router.decode[0]
        occupant = await occupy(router)
        decode.reply_gates.update(A=asyncio.Event(), B=asyncio.Event())
        a = router.generate(GenerateRequest("A", PROMPTS[1], HOLD))
        a_first = asyncio.ensure_future(a.__anext__())
        await decode.answered["A"].wait()
        b = router.generate(GenerateRequest("B", PROMPTS[2], HOLD))
        b_first = asyncio.ensure_future(b.__anext__())
        await decode.answered["B"].wait()  # both refused
        await occupant.aclose()
        decode.reply_gates["B"].set()
        decode.reply_gates["A"].set()
        await _first_admitted_is_a_then_b(router, a, a_first, b, b_first)


async def test_without_a_queue_an_arrival_tries_even_beside_a_refusal_on_its_way(workers, tiny_checkpoint) -> None:
    """max_queued_requests=0 (never wait): with nothing queued there is no order to keep, so B, arriving after
    the slot opened while A's refusal is on its way, tries and gets the slot instead of a 503 without trying."""
    async with serving(workers, tiny_checkpoint, max_queued_requests=0, refresh_seconds=3600) as router:
        decode = router.decode[0]
        occupant = await occupy(router)
        decode.reply_gates["A"] = asyncio.Event()
        a = asyncio.ensure_future(_tokens(router, "A", PROMPTS[1]))
        await decode.answered["A"].wait()
        await occupant.aclose()
        b = router.generate(GenerateRequest("B", PROMPTS[2], HOLD))
        await b.__anext__()
        decode.reply_gates["A"].set()
        with pytest.raises(EngineOverloadedError, match="no decode replica has room"):
            await a
        assert decode.admitted == ["occupant", "B"]
        await b.aclose()


async def _first_admitted_is_a_then_b(router: DisaggregatedRouter, a, a_first, b, b_first) -> None:
    """A gets the one slot while B waits (at most the free slots are granted); B gets it when A ends."""
    await asyncio.wait({a_first, b_first}, return_when=asyncio.FIRST_COMPLETED)
    decode = router.decode[0]
    assert decode.admitted == ["occupant", "A"]
    await a_first
    assert not b_first.done() and router.admission.num_waiting == 1
    await a.aclose()
    await b_first
    assert decode.admitted == ["occupant", "A", "B"]
    await b.aclose()


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
        assert queue_times(router)[0] == 1  # the occupant's: the one turned away never waited
        await occupant.aclose()
        assert await waiting == reference[1]
        assert router.decode[0].admitted == ["occupant", "waits"]
        assert queue_times(router)[0] == 2


async def test_a_request_that_waits_longer_than_the_queue_timeout_gets_503(workers, tiny_checkpoint) -> None:
    async with serving(workers, tiny_checkpoint, queue_timeout_seconds=0.3) as router:
        occupant = await occupy(router)
        started = time.monotonic()
        with pytest.raises(EngineOverloadedError, match=r"waited 0\.3 s for room on a decode replica"):
            await _tokens(router, "too-late", PROMPTS[1])
        assert 0.3 <= time.monotonic() - started < 2.0
        assert router.admission.num_waiting == 0 and queued(router) == 0
        count, seconds = queue_times(router)
        assert count == 2 and seconds >= 0.3  # the occupant's admission, and the wait that timed out
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
        assert queue_times(router)[0] == 2  # the occupant's admission, and the cancelled wait
        await occupant.aclose()
        assert await behind == reference[2]
        assert router.decode[0].admitted == ["occupant", "behind"]
        assert queue_times(router)[0] == 3


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


async def test_ids_outside_the_vocabulary_get_the_engines_400_at_once_even_with_the_queue_full(
    workers, tiny_checkpoint
) -> None:
    """Through the app, while the only decode slot is taken and max_queued_requests wait: a prompt token
    id and a logit_bias key outside the vocabulary are refused by the ingress itself, with the 400 the
    engines answer (their check), not a 503 for the full queue, nor after a wait; no engine sees them."""
    async with serving(workers, tiny_checkpoint, max_queued_requests=1) as router:
        vocab = router.vocab_size
        occupant = await occupy(router)
        waiting = asyncio.create_task(_tokens(router, "waits", PROMPTS[1]))
        await until(lambda: router.admission.num_waiting == 1, "the queue full")
        transport = httpx.ASGITransport(app=build_app(router, router.metrics))
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as http:
            started = time.monotonic()
            token = await http.post("/v1/completions", json={"prompt": [1, 2, vocab], "max_tokens": 4})
            bias = await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logit_bias": {"5": 1, str(vocab): 1}})
            assert time.monotonic() - started < 1.0
        assert (token.status_code, token.json()) == (400, {"error": {
            "message": f"prompt token ids [{vocab}] are outside the vocabulary [0, {vocab})",
            "type": "invalid_request_error", "param": None, "code": 400}})
        assert (bias.status_code, bias.json()) == (400, {"error": {
            "message": f"logit_bias must use token ids in the vocabulary [0, {vocab}), got [{vocab}]",
            "type": "invalid_request_error", "param": "logit_bias", "code": 400}})
        assert router.admission.num_waiting == 1
        await occupant.aclose()
        await waiting
        assert set(router.decode[0].answered) == {"occupant", "waits"}
        assert router.prefill[0].asked == ["occupant", "waits"]


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

    router, _ = _router(config, [], [], str(tiny_checkpoint), MODEL)
    assert (router.admission.max_queued, router.admission.timeout_seconds) == (5, 2.5)
