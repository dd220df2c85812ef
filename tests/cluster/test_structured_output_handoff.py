"""Structured outputs across the disaggregated handoff: a real router over an in-process prefill worker and decode
worker (1P1D, transfer "local", the tiny model with random weights; test_decode_feed's workers).

The prefill engine samples the first token under the constraint; the decode engine makes the request's matcher,
feeds it that token before its first decode step, and constrains the rest. A regex of fixed length ("[ab]{5}")
checks the join: a decode matcher that missed the first token would allow five more characters, six in all.

- regex (greedy and sampled) and JSON schema outputs are of their language and finish "stop";
- a constraint that does not compile is a ValueError at admission, before any prompt runs, and leaves nothing;
- admission compiles the constraint off the decode engine's thread (the engine answers while the compile is held),
  and a request aborted meanwhile gets no reservation;
- on the decode engine, a first token the constraint rejects fails the request (RequestFailedError on its stream)
  and frees its reservation; an allowed one is continued under the constraint.
Afterwards the decode engine holds no request, reservation or matcher.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from k3serve.cluster.router import DisaggregatedRouter
from k3serve.decode.worker import DecodeWorker
from k3serve.transfer.control import UnknownRequestError
from k3serve.engine.llm import LLM
from k3serve.engine.outputs import RequestFailedError
from k3serve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer

from _held_compile import HeldCompile
from test_decode_feed import ENGINE_ARGS, workers  # noqa: F401  (workers: the in-process 1P1D fixture)

pytestmark = pytest.mark.timeout(120)

REGEX = "[ab]{5}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
          "required": ["ok", "size"], "additionalProperties": False}
PROMPT = [(j * 7) % 450 + 20 for j in range(30)]


def constrained(temperature: float = 0.0, seed: int | None = None, max_tokens: int = 300,
                **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def serve(workers, tiny_checkpoint: Path, requests: list[tuple[str, SamplingParams]]) -> list:
    """Each request through a fresh router: its deltas, or the error that ended it. Then the decode engine must be
    idle and hold no matcher."""
    prefill, decode = workers

    async def run():
        router = DisaggregatedRouter([prefill], [decode], Tokenizer.from_dir(tiny_checkpoint), "k3-tiny",
                                     ENGINE_ARGS["max_model_len"], ModelConfig.from_dir(tiny_checkpoint).vocab_size)

        async def one(request_id: str, params: SamplingParams):
            return [d async for d in router.generate(GenerateRequest(request_id, PROMPT, params))]

        try:
            return await asyncio.gather(*(one(rid, p) for rid, p in requests), return_exceptions=True)
        finally:
            await router.close()

    results = asyncio.run(asyncio.wait_for(run(), 60))
    assert_decode_idle(decode)
    return results


def assert_decode_idle(decode: DecodeWorker) -> None:
    engine = decode.handoff._engine.engine  # white box: the matchers are no stats of the seam

    def held():
        s = decode.handoff.stats(num_reserved=len(decode._pending))
        return (s.num_running, s.num_waiting, s.num_reserved, s.block_usage, s.slot_usage,
                engine.structured_outputs.num_matchers)

    assert decode.handoff.submit(held).result(timeout=10) == (0, 0, 0, 0, 0, 0)


def text_of(deltas) -> str:
    return "".join(d.new_text for d in deltas)


def test_constrained_outputs_hold_across_the_handoff(workers, tiny_checkpoint):
    requests = [("greedy", constrained(regex=REGEX)), ("json", constrained(json=SCHEMA))]
    requests += [(f"sampled-{seed}", constrained(1.0, seed, regex=REGEX)) for seed in range(3)]
    results = dict(zip((rid for rid, _ in requests), serve(workers, tiny_checkpoint, requests)))
    for request_id, deltas in results.items():
        assert not isinstance(deltas, BaseException), (request_id, deltas)
        assert deltas[-1].finish_reason == "stop", (request_id, deltas[-1])
        assert len(deltas) > 2, f"{request_id}: the decode engine generated under the constraint"
        if request_id == "json":
            value = json.loads(text_of(deltas))
            assert set(value) == {"ok", "size"}, value
            assert type(value["ok"]) is bool and value["size"] in ("S", "M", "L"), value
        else:
            assert re.fullmatch(REGEX, text_of(deltas)), (request_id, text_of(deltas))
    alone = LLM(str(tiny_checkpoint), **ENGINE_ARGS).generate(PROMPT, constrained(regex=REGEX))[0].outputs[0]
    assert [t for d in results["greedy"] for t in d.new_token_ids] == alone.token_ids  # greedy: the same tokens


def test_a_constraint_that_does_not_compile_is_refused_at_admission(workers, tiny_checkpoint):
    _, decode = workers
    [error] = serve(workers, tiny_checkpoint, [("bad", constrained(regex="[ab"))])
    assert isinstance(error, ValueError) and "regex does not compile" in str(error)
    with pytest.raises(ValueError, match="regex does not compile"):  # the decode worker's admit: no reservation
        asyncio.run(decode.admit("bad-admit", PROMPT, constrained(regex="[ab")))
    assert_decode_idle(decode)


def test_admission_compiles_off_the_engine_thread_and_an_abort_meanwhile_leaves_no_reservation(workers):
    """The ingress aborts a request whose admission is compiling its constraint (a router in another process: its
    abort comes as a call of its own, not as the admission's cancellation)."""
    _, decode = workers
    held = HeldCompile()
    compiler = decode.handoff._engine.engine.structured_outputs.compiler  # white box: the test's compile hook
    compiler.on_compile = held

    async def admit_then_abort():
        admission = asyncio.create_task(decode.admit("aborted", PROMPT, constrained(regex="[cd]{4}")))
        await held.wait_started()
        answered = await asyncio.wait_for(decode.handoff.call(lambda: len(decode._pending)), 10)
        await decode.abort_request("aborted")
        held.release()
        with pytest.raises(UnknownRequestError, match="aborted during its admission"):
            await admission
        return answered

    try:
        assert asyncio.run(asyncio.wait_for(admit_then_abort(), 30)) == 0, "reserved before its grammar was ready"
    finally:
        compiler.on_compile = None
    assert_decode_idle(decode)


def test_the_decode_engine_checks_the_handed_off_token_against_the_constraint(workers, tiny_checkpoint):
    """Adoption straight through the handoff seam (what `DecodeWorker._adopt` does once the state landed): an
    allowed first token is continued under the constraint, a rejected one fails its request and frees its
    reservation."""
    _, decode = workers
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)
    allowed, rejected = tokenizer.encode("a")[0], tokenizer.encode("c")[0]

    async def adopt(request_id: str, first_token_id: int):
        handoff = decode.handoff
        stream = handoff.stream(request_id)

        def add():
            handoff.adopt(handoff.reserve(request_id, len(PROMPT)), PROMPT, first_token_id, constrained(regex=REGEX))

        await handoff.call(add)
        try:
            return [d async for d in stream]
        except RequestFailedError as e:
            return e

    continued = asyncio.run(asyncio.wait_for(adopt("continued", allowed), 30))
    failed = asyncio.run(asyncio.wait_for(adopt("failed", rejected), 30))
    assert continued[0].new_token_ids == [allowed] and re.fullmatch(REGEX, text_of(continued))
    assert isinstance(failed, RequestFailedError) and f"token {rejected} is not allowed" in str(failed)
    assert_decode_idle(decode)
