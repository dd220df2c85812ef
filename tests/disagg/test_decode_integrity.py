"""Specification of decode's integrity checks after adoption (decode/worker.py): state changed behind the engine's
back fails the request with an error, counted and logged; it never continues into a wrong answer.

Real in-process workers (prefill + decode, transfer "local", the tiny model). The hostile peer is a real local
transfer agent that learned the decode's regions (as a handshake with the deployment's secret, or a stale one,
gives them) and writes 1e30 over a request's MLA blocks and KDA slot with one-sided writes:

    adoption (checksums verified)  ->  hostile write lands  ->  before the first decode step: re-checked, failed
    first decode step  ->  ... hostile write lands ...  ->  a random step (reverify_probability=1): failed
    no write: every check passes, the output is the colocated engine's
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from k3serve.decode.worker import DecodeWorker
from k3serve.engine.outputs import RequestFailedError
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.prefill.messages import HandoffTarget
from k3serve.prefill.worker import PrefillWorker
from k3serve.transfer.backend import WriteOp
from k3serve.transfer.local import LocalBackend

pytestmark = pytest.mark.timeout(120)

ENGINE_ARGS = dict(block_size=16, max_model_len=512, cache_memory_bytes=64 << 20)
PROMPT = [(j * 7) % 450 + 20 for j in range(40)]
LONG = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def integrity_failures(decode: DecodeWorker, stage: str) -> float:
    value = REGISTRY.get_sample_value("k3serve:transfer_integrity_failures_total",
                                      {"model_name": decode.handoff.model_name, "role": "decode", "stage": stage})
    return value or 0.0


class HostilePeer:
    """A local agent that writes 1e30 over the MLA blocks and the KDA slot of a decode reservation."""

    def __init__(self, decode: DecodeWorker) -> None:
        self.layout = decode.receiver.layout
        self.regions = decode.receiver.regions
        self.agent = LocalBackend()
        self.poison = torch.full((1 << 18,), 1e30, dtype=torch.float32)
        self.source = self.agent.register("poison", self.poison)
        self.peer = self.agent.connect(decode.receiver.backend.agent_info())

    def write(self, block_id: int, slot_id: int) -> None:
        """Post the writes and land them now (a local batch lands at its first poll)."""
        ops = [WriteOp(self.source.addr, self.regions[r.name].addr + block_id * r.bytes_per_block, r.bytes_per_block)
               for r in self.layout.mla]
        ops += [WriteOp(self.source.addr, self.regions[r.name].addr + slot_id * r.bytes_per_slot, r.bytes_per_slot)
                for r in self.layout.kda_recurrent]
        assert all(op.length <= self.source.length for op in ops)
        handle = self.agent.write(self.peer, ops)
        assert self.agent.poll(handle).value == "done"
        self.agent.release(handle)

    def close(self) -> None:
        self.agent.close()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> list[int]:
    llm = LLM(model=str(tiny_checkpoint), **ENGINE_ARGS)
    return llm.generate([PROMPT], SHORT)[0].outputs[0].token_ids


def _pair(model: Path, **decode_kw) -> tuple[PrefillWorker, DecodeWorker]:
    args = EngineArgs(model=str(model), **ENGINE_ARGS)
    return PrefillWorker(args), DecodeWorker(args, **decode_kw)


async def _collect(stream) -> list[int]:
    tokens: list[int] = []
    async for delta in stream:
        tokens += delta.new_token_ids
    return tokens


def test_a_write_after_adoption_fails_the_request_before_its_first_decode_step(tiny_checkpoint: Path) -> None:
    prefill, decode = _pair(tiny_checkpoint)
    hostile = HostilePeer(decode)
    before = integrity_failures(decode, "first_step")

    def write_right_after_adoption(request_id: str) -> None:
        """Engine thread, holding it: once every prefill rank reported (decode rank 0 queues the adoption next),
        queue the hostile write behind the adoption, so it lands after the verification and before any step."""
        deadline = time.monotonic() + 30
        while not (decode._pending.get(request_id) and decode._pending[request_id].shares):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        time.sleep(0.05)  # the gRPC thread queues the adoption now
        state = decode._pending[request_id].state
        decode.handoff.submit(lambda: hostile.write(state.block_ids[0], state.slot_id))

    async def main() -> None:
        reservation = await decode.admit("victim", PROMPT, LONG)
        stream = decode.stream("victim")
        held = threading.Thread(target=lambda: decode.handoff.submit(
            lambda: write_right_after_adoption("victim")).result())
        held.start()
        await prefill.prefill("victim", PROMPT, LONG, HandoffTarget(await decode.addresses(), reservation))
        with pytest.raises(RequestFailedError, match="changed after the handoff was verified"):
            await _collect(stream)
        held.join()
        stats = await decode.stats()
        assert (stats.num_running, stats.num_reserved) == (0, 0)

    try:
        asyncio.run(main())
    finally:
        hostile.close()
        prefill.shutdown()
        decode.shutdown()
    assert integrity_failures(decode, "first_step") == before + 1


def test_a_write_during_decoding_fails_the_request_at_a_random_check(tiny_checkpoint: Path) -> None:
    prefill, decode = _pair(tiny_checkpoint, reverify_probability=1.0)
    hostile = HostilePeer(decode)
    before = integrity_failures(decode, "step")

    async def main() -> int:
        reservation = await decode.admit("victim", PROMPT, LONG)
        stream = decode.stream("victim")
        await prefill.prefill("victim", PROMPT, LONG, HandoffTarget(await decode.addresses(), reservation))
        num_tokens = 0
        with pytest.raises(RequestFailedError, match="changed after the handoff was verified"):
            async for delta in stream:
                num_tokens += len(delta.new_token_ids)
                if num_tokens >= 3 and num_tokens - len(delta.new_token_ids) < 3:  # decoding: write now, once
                    hostile.write(reservation.block_ids[0], reservation.slot_id)
        return num_tokens

    try:
        num_tokens = asyncio.run(main())
    finally:
        hostile.close()
        prefill.shutdown()
        decode.shutdown()
    assert num_tokens < LONG.max_tokens  # failed, not finished
    assert integrity_failures(decode, "step") == before + 1


@pytest.mark.parametrize("reverify_probability", [0.0, 1.0])
def test_untouched_state_passes_every_check_and_matches_the_colocated_engine(
        tiny_checkpoint: Path, reference: list[int], reverify_probability: float) -> None:
    prefill, decode = _pair(tiny_checkpoint, reverify_probability=reverify_probability)
    failures = integrity_failures(decode, "first_step") + integrity_failures(decode, "step")

    async def main() -> list[int]:
        reservation = await decode.admit("clean", PROMPT, SHORT)
        stream = decode.stream("clean")
        result = await prefill.prefill("clean", PROMPT, SHORT, HandoffTarget(await decode.addresses(), reservation))
        return await _collect(stream), result.first_token_id

    try:
        tokens, first = asyncio.run(main())
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert tokens == reference and tokens[0] == first
    assert integrity_failures(decode, "first_step") + integrity_failures(decode, "step") == failures
