"""The router's decode feed (`cluster/decode_feed.py`): one stream per (router, decode replica)
that carries, per engine step, the deltas of every request the router admitted there. Real
in-process workers (prefill + decode, transfer "local", the tiny model), a real router.

- 8 concurrent requests through one decode replica each get exactly their own tokens, in order
  (greedy: the offline engine's tokens), and the feed carries them in fewer items than deltas
  (a step's deltas travel together).
- A request whose consumer does not read holds back no other request and loses nothing.
- A feed cut mid-stream (what a dead decode actor does) ends every request on it with
  ReplicaDiedError at once (migration off); the decode pool is freed, and the next request opens a new feed.
- A client that leaves mid-stream frees the decode pool; so does one that leaves while its admit's
  answer is on the way (at once, not when the reservation's lease runs out).
- A decode replica that restarted while the router's feed from it still looks open (admit answers
  UnknownFeedError): the requests on the old feed end with ReplicaDiedError, the router opens a
  new feed once and the new request is served there, at the replica's new address; the replica
  stays healthy.
- A restart the feed did see (its feed was cut, as the replica's death cuts it): the next request
  is handed off to the restarted replica's addresses at once, not to the dead one's until the
  next stats refresh.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from k3serve.cluster.errors import ReplicaDiedError
from k3serve.cluster.router import DisaggregatedRouter
from k3serve.decode.worker import DecodeWorker
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer
from k3serve.prefill.worker import PrefillWorker

from _faulty_replicas import wait_decode_idle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ENGINE_ARGS = dict(block_size=16, max_model_len=512, cache_memory_bytes=64 << 20)
PROMPTS = [[(i * 17 + j * 7) % 450 + 20 for j in range(24 + i)] for i in range(8)]
NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


class CuttableDecode:
    """A decode worker whose feeds can be cut as its process's death would cut them; the rest
    passes through (to `worker`: swapping it is what a Ray handle does when its actor restarts).
    Counts the feed items and the deltas they carried."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker, self.name = worker, worker.name
        self.cut = asyncio.Event()
        self.num_items = self.num_deltas = 0
        self.admit_reply_s = 0.0

    async def feed(self, feed_id: str):
        batches = self.worker.feed(feed_id).__aiter__()
        try:
            while True:
                next_batch = asyncio.ensure_future(batches.__anext__())
                cut = asyncio.ensure_future(self.cut.wait())
                await asyncio.wait([next_batch, cut], return_when=asyncio.FIRST_COMPLETED)
                if cut.done():
                    next_batch.cancel()
                    raise ReplicaDiedError(f"decode replica {self.name} died")
                cut.cancel()
                batch = next_batch.result()
                self.num_items += 1
                self.num_deltas += len(batch)
                yield batch
        finally:
            await batches.aclose()

    async def admit(self, *args):
        reservation = await self.worker.admit(*args)
        await asyncio.sleep(self.admit_reply_s)  # the reply on its way back to the router
        return reservation

    def __getattr__(self, name: str):
        return getattr(self.worker, name)


@pytest.fixture(scope="module")
def workers(tiny_checkpoint: Path):
    args = EngineArgs(model=str(tiny_checkpoint), **ENGINE_ARGS)
    prefill = PrefillWorker(args, transfer="local", name="prefill-0")
    decode = DecodeWorker(args, transfer="local", name="decode-0")
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> list[list[int]]:
    llm = LLM(str(tiny_checkpoint), **ENGINE_ARGS)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture
async def router(workers, tiny_checkpoint: Path):
    prefill, decode = workers
    router = DisaggregatedRouter([prefill], [CuttableDecode(decode)], Tokenizer.from_dir(tiny_checkpoint),
                                 "k3-tiny", ENGINE_ARGS["max_model_len"],
                                 ModelConfig.from_dir(tiny_checkpoint).vocab_size)
    yield router
    await router.close()
    await wait_decode_idle(decode)


async def _tokens(router: DisaggregatedRouter, rid: str, prompt: list[int], params=GREEDY) -> list[int]:
    """A request's tokens, checking each delta continues the previous ones."""
    tokens: list[int] = []
    async for delta in router.generate(GenerateRequest(rid, prompt, params)):
        tokens += delta.new_token_ids
        assert delta.request_id == rid and delta.num_output_tokens == len(tokens), (rid, delta)
    return tokens


async def test_concurrent_requests_get_their_own_tokens_in_order_in_batched_items(router, reference) -> None:
    decode = router.decode[0]
    got = await asyncio.gather(*(_tokens(router, f"many-{i}", p) for i, p in enumerate(PROMPTS)))
    assert got == reference
    assert decode.num_deltas >= len(PROMPTS) * (NUM_TOKENS - 1)  # the first token may come from prefill
    assert decode.num_items < decode.num_deltas / 2, (decode.num_items, decode.num_deltas)


async def test_a_consumer_that_does_not_read_holds_back_nothing(router, reference) -> None:
    stalled = router.generate(GenerateRequest("stalled", PROMPTS[0], GREEDY))
    first = await stalled.__anext__()  # admitted and decoding; then nobody reads it
    others = await asyncio.wait_for(
        asyncio.gather(*(_tokens(router, f"busy-{i}", p) for i, p in enumerate(PROMPTS[1:4], 1))), 30)
    assert others == reference[1:4]
    rest = [t for delta in [d async for d in stalled] for t in delta.new_token_ids]
    assert first.new_token_ids + rest == reference[0]


async def test_a_cut_feed_ends_every_request_on_it_and_the_next_request_opens_a_new_one(router, reference) -> None:
    """With migration off (`migrate_on_decode_failure`: tests/cluster/test_migration.py has it on)."""
    router.migrate_on_decode_failure = False
    decode = router.decode[0]
    streaming: set[str] = set()
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def until_cut(rid: str, prompt: list[int]) -> BaseException | None:
        try:
            async for _ in router.generate(GenerateRequest(rid, prompt, long)):
                streaming.add(rid)
        except ReplicaDiedError as e:
            return e
        return None

    requests = [asyncio.create_task(until_cut(f"cut-{i}", p)) for i, p in enumerate(PROMPTS[:4])]
    while len(streaming) < len(requests):
        await asyncio.sleep(0.01)
    decode.cut.set()
    errors = await asyncio.wait_for(asyncio.gather(*requests), 5)
    assert all(isinstance(e, ReplicaDiedError) for e in errors), errors
    await wait_decode_idle(decode.worker)  # the router aborted them on the (live) worker
    decode.cut.clear()
    assert await _tokens(router, "after-cut", PROMPTS[5]) == reference[5]


async def test_a_client_that_leaves_mid_stream_frees_the_decode_pool(router) -> None:
    stream = router.generate(GenerateRequest("leaves", PROMPTS[2], SamplingParams(max_tokens=400, ignore_eos=True)))
    for _ in range(3):
        await stream.__anext__()
    await stream.aclose()
    await wait_decode_idle(router.decode[0].worker)


async def test_a_client_that_leaves_while_admitted_frees_the_reservation_at_once(router) -> None:
    decode = router.decode[0]
    decode.admit_reply_s = 1.0
    try:
        request = asyncio.ensure_future(_tokens(router, "leaves-in-admit", PROMPTS[1]))
        for _ in range(100):  # until the worker holds the reservation; its answer is still on the way
            await asyncio.sleep(0.01)
            if (await decode.worker.stats()).num_reserved:
                break
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    finally:
        decode.admit_reply_s = 0.0
    await wait_decode_idle(decode.worker, deadline_s=2.0)  # its lease is 30 s


async def test_a_request_that_ends_at_its_first_token_frees_its_decode_reservation_at_once(router) -> None:
    """max_tokens=1 ends on the prefill replica: nothing is handed off, so the router releases the
    reservation it made on decode (it used to wait for the lease to expire)."""
    assert len(await _tokens(router, "one-token", PROMPTS[1], SamplingParams(max_tokens=1))) == 1
    await wait_decode_idle(router.decode[0].worker, deadline_s=2.0)


@pytest.fixture(scope="module")
def restarted_decode(tiny_checkpoint: Path):
    """A second decode worker under the same name: the replica after a restart."""
    worker = DecodeWorker(EngineArgs(model=str(tiny_checkpoint), **ENGINE_ARGS), transfer="local", name="decode-0")
    yield worker
    worker.shutdown()


async def test_a_restarted_decode_replica_gets_a_new_feed_and_serves(router, reference, restarted_decode) -> None:
    router.migrate_on_decode_failure = False  # the old feed's request ends, as it does with migration off
    decode = router.decode[0]
    before = decode.worker
    old_feed = router.generate(GenerateRequest("on-old-feed", PROMPTS[0], SamplingParams(max_tokens=400,
                                                                                         ignore_eos=True)))
    await old_feed.__anext__()  # the feed to the first instance is open and carrying a request
    decode.worker = restarted_decode  # the replica restarted; the old feed has not ended yet
    try:
        assert await _tokens(router, "after-restart", PROMPTS[3]) == reference[3]
        with pytest.raises(ReplicaDiedError, match="restarted"):
            async for _ in old_feed:
                pass
        assert router._healthy.get(decode.name, True)
        await wait_decode_idle(before)  # the old feed closed: its request was aborted there
    finally:
        decode.worker = before


async def test_a_restart_its_feed_saw_hands_the_next_request_to_the_new_addresses(
    workers, tiny_checkpoint: Path, reference, restarted_decode
) -> None:
    prefill, before = workers
    decode = CuttableDecode(before)
    router = DisaggregatedRouter([prefill], [decode], Tokenizer.from_dir(tiny_checkpoint), "k3-tiny",
                                 ENGINE_ARGS["max_model_len"], ModelConfig.from_dir(tiny_checkpoint).vocab_size,
                                 refresh_seconds=3600.0)  # no refresh meanwhile
    try:
        assert await _tokens(router, "before-restart", PROMPTS[0]) == reference[0]
        decode.worker = restarted_decode  # the replica died and restarted ...
        decode.cut.set()  # ... which cut its feed
        await asyncio.sleep(0.05)
        decode.cut.clear()
        assert await _tokens(router, "after-seen-restart", PROMPTS[4]) == reference[4]
    finally:
        await router.close()
        decode.worker = before
    await wait_decode_idle(before)
    await wait_decode_idle(restarted_decode)
