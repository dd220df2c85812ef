"""Fenced handoff retries: every prefill attempt writes into a decode reservation of its own.

Real in-process workers (2 prefill, 2 decode, transfer "local", the tiny model) behind handles that fail as
Ray actors do (`_faulty_replicas.py`), a real router.

- A prefill replica that handed off in full (decode adopted the request) and then lost its reply: the retry
  gets a new reservation with a new attempt number, the adopted request is dropped, and the answer is the
  colocated greedy one; a TransferReady naming the first attempt is refused and leaves the live reservation
  intact.
- The decode replica dies between the admission and the handoff: the retry reserves on the live replica and
  succeeds (it used to retry into the dead replica's reservation: 503).
- Decode refuses a TransferReady for an attempt other than the live reservation's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from k3serve.cluster.router import DisaggregatedRouter
from k3serve.decode.worker import DecodeWorker
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer
from k3serve.prefill.worker import PrefillWorker
from k3serve.transfer.control import UnknownRequestError

from _faulty_replicas import FlakyPrefill, KillableDecode, wait_decode_idle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ENGINE_ARGS = dict(block_size=16, max_model_len=512, cache_memory_bytes=64 << 20)
PROMPT = [(j * 7) % 450 + 20 for j in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_args(tiny_checkpoint: Path) -> EngineArgs:
    return EngineArgs(model=str(tiny_checkpoint), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def prefill_workers(engine_args):
    workers = [PrefillWorker(engine_args, transfer="local", name=f"prefill-{i}") for i in range(2)]
    yield workers
    for w in workers:
        w.shutdown()


@pytest.fixture(scope="module")
def live_decode(engine_args):
    worker = DecodeWorker(engine_args, transfer="local", name="decode-1")
    yield worker
    worker.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> list[int]:
    return LLM(str(tiny_checkpoint), **ENGINE_ARGS).generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def _router(prefill, decode, tiny_checkpoint: Path) -> DisaggregatedRouter:
    return DisaggregatedRouter(prefill, decode, Tokenizer.from_dir(tiny_checkpoint), "k3-tiny",
                               ENGINE_ARGS["max_model_len"], ModelConfig.from_dir(tiny_checkpoint).vocab_size)


async def _tokens(router: DisaggregatedRouter, rid: str) -> list[int]:
    return [t async for d in router.generate(GenerateRequest(rid, PROMPT, GREEDY)) for t in d.new_token_ids]


async def test_an_ambiguous_prefill_failure_is_retried_into_a_new_reservation(
    prefill_workers, live_decode, reference, tiny_checkpoint: Path
) -> None:
    prefill = [FlakyPrefill(w) for w in prefill_workers]
    calls: list = []  # every attempt's target, in order
    refused: list[BaseException] = []

    async def before(replica: FlakyPrefill, target) -> None:
        calls.append(target)
        if len(calls) == 1:
            replica.after_handoff = 1  # hands off in full (decode adopts), then its reply is lost
        else:  # the retry, before it pushes: the first attempt's late TransferReady, as a stale replica sends it
            try:
                live_decode.transfer_ready("fenced", 0, 1, len(PROMPT), {"0/mla.0": "00"}, calls[0].reservation.attempt)
            except UnknownRequestError as e:
                refused.append(e)

    for p in prefill:
        p.before = before
    router = _router(prefill, [live_decode], tiny_checkpoint)
    try:
        assert await _tokens(router, "fenced") == reference
    finally:
        await router.close()
    assert [len(p.targets) for p in prefill] == [1, 1]  # the retry ran on the other replica
    assert calls[1].reservation.attempt > calls[0].reservation.attempt
    assert len(refused) == 1, "the first attempt's TransferReady must be refused once the retry holds the reservation"
    await wait_decode_idle(live_decode)


async def test_a_retry_after_the_decode_replica_died_lands_on_the_live_one(
    prefill_workers, engine_args, live_decode, reference, tiny_checkpoint: Path
) -> None:
    victim = KillableDecode(DecodeWorker(engine_args, transfer="local", name="decode-0"))
    prefill = [FlakyPrefill(prefill_workers[0])]

    async def kill_the_target(replica: FlakyPrefill, target) -> None:
        if len(replica.targets) == 1:
            await victim.kill()  # admitted there; dies before the handoff lands

    prefill[0].before = kill_the_target
    router = _router(prefill, [victim, live_decode], tiny_checkpoint)
    try:
        assert await _tokens(router, "after-death") == reference
    finally:
        await router.close()
    assert [t.decode_addresses for t in prefill[0].targets] == [
        victim.worker.control_addresses, live_decode.control_addresses]
    await wait_decode_idle(live_decode)


async def test_decode_refuses_a_transfer_ready_for_another_attempt(live_decode) -> None:
    first = await live_decode.admit("attempts", PROMPT, GREEDY)
    await live_decode.abort_request("attempts")
    second = await live_decode.admit("attempts", PROMPT, GREEDY)
    try:
        assert second.attempt > first.attempt
        with pytest.raises(UnknownRequestError, match="attempt"):
            live_decode.transfer_ready("attempts", 0, 1, len(PROMPT), {"0/mla.0": "00"}, first.attempt)
        assert (await live_decode.stats()).num_reserved == 1  # the live reservation is untouched
    finally:
        await live_decode.abort_request("attempts")
    await wait_decode_idle(live_decode)
