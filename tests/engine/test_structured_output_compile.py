"""Specification: a structured output constraint compiles off the engine thread (`GrammarCompiler`'s threads), and
`AsyncEngine` keeps its request aside until the grammar is ready, on the tiny model.

A compile is held deterministically (`_held_compile.HeldCompile`, the compiler's `on_compile` hook).

- while a constrained request's compile is held, a running request keeps producing tokens, and the constrained
  request is not in the engine; released, it completes under its constraint;
- a request aborted while its grammar compiles (by `abort`, or by its consumer leaving) ends at once and leaves
  nothing behind: the engine never takes it, even when the compile completes afterwards (its grammar is cached);
- requests for a constraint being compiled share that compilation, and every compilation runs on the compiler's
  threads, never on the engine thread nor on the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest

from k3serve.engine.async_engine import AsyncEngine
from k3serve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.engine.structured_output import GrammarCompiler
from k3serve.model.tokenizer import Tokenizer

from _held_compile import HOLD_TIMEOUT_S as TIMEOUT_S, HeldCompile
from _llm_harness import make_async_engine  # noqa: F401  (fixture)

REGEX = "[ab]{5}"
TOKENS_WHILE_HELD = 8  # the running request's tokens the test waits for while the compile is held


def constrained() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=REGEX))


def held_engine(make_async_engine) -> tuple[AsyncEngine, HeldCompile]:  # noqa: F811
    engine = make_async_engine()
    held = HeldCompile()
    engine.engine.structured_outputs.compiler.on_compile = held
    return engine, held


def test_a_running_request_keeps_decoding_while_a_constraint_compiles(make_async_engine):  # noqa: F811
    engine, held = held_engine(make_async_engine)

    async def run():
        running = engine.generate(GenerateRequest(
            "running", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)))
        first = [await anext(running)]
        compiling = asyncio.create_task(collect(engine.generate(GenerateRequest("constrained", [1, 2, 3],
                                                                                constrained()))))
        await held.wait_started()
        while_held = [await anext(running) for _ in range(TOKENS_WHILE_HELD)]  # a stalled engine hangs here
        in_engine = await engine.call(lambda e: ("constrained" in e.scheduler.requests,
                                                 e.structured_outputs.num_matchers))
        assert not compiling.done()
        held.release()
        return first + while_held + [d async for d in running], await compiling, in_engine

    running, constrained_deltas, in_engine = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert in_engine == (False, 0), "the constrained request entered the engine before its grammar was ready"
    assert sum(len(d.new_token_ids) for d in running) == 64 and running[-1].finish_reason == "length"
    assert re.fullmatch(REGEX, "".join(d.new_text for d in constrained_deltas))
    assert constrained_deltas[-1].finish_reason == "stop"
    assert held.thread_names and all(name.startswith("k3serve-grammar") for name in held.thread_names)


@pytest.mark.parametrize("how", ["abort", "consumer_leaves"])
def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(make_async_engine, how):  # noqa: F811
    engine, held = held_engine(make_async_engine)
    compiler = engine.engine.structured_outputs.compiler

    async def run():
        stream = engine.generate(GenerateRequest("r", [1, 2, 3], constrained()))
        first = asyncio.create_task(anext(stream))
        await held.wait_started()
        same_compile = compiler.compile_async(constrained().structured_outputs)  # done after the engine's
        if how == "abort":
            await engine.abort("r")
            last = await first
            assert (last.finished, last.finish_reason, last.new_token_ids) == (True, "abort", [])
        else:
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            await stream.aclose()
        held.release()
        await asyncio.wrap_future(same_compile)  # the engine heard of the compile's end before this returns
        left = await engine.call(lambda e: (dict(e.scheduler.requests), e.structured_outputs.num_matchers,
                                            dict(engine._awaiting_grammar)))
        again = await collect(engine.generate(GenerateRequest("r", [1, 2, 3], constrained())))
        return left, again

    left, again = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert left == ({}, 0, {}), "the aborted request was left in the engine"
    assert compiler.num_compiled == 1, "the compile completed and was cached"
    assert re.fullmatch(REGEX, "".join(d.new_text for d in again)) and again[-1].finish_reason == "stop"


def test_requests_for_a_constraint_being_compiled_share_the_compilation(tiny_checkpoint):
    compiler = GrammarCompiler(Tokenizer.from_dir(tiny_checkpoint), 512)
    held = HeldCompile()
    compiler.on_compile = held
    constraint = StructuredOutputsParams(regex=REGEX)
    futures = [compiler.compile_async(constraint)]
    assert held.started.wait(TIMEOUT_S)
    futures += [compiler.compile_async(StructuredOutputsParams(regex=REGEX)) for _ in range(3)]
    futures[1].cancel()  # one caller going away cancels nobody else's wait, nor the compilation
    assert not any(f.done() for f in futures[2:])
    held.release()
    grammars = [f.result(TIMEOUT_S) for f in futures if not f.cancelled()]
    assert len(grammars) == 3 and all(g is grammars[0] for g in grammars)
    assert compiler.compile(constraint) is grammars[0]
    assert compiler.num_compiled == 1 and held.thread_names == ["k3serve-grammar_0"]
    compiler.close()


async def collect(stream) -> list:
    return [d async for d in stream]


def test_a_compile_that_fails_unexpectedly_fails_its_request_not_the_engine(make_async_engine):  # noqa: F811
    """A compile error other than the constraint's own (ValueError: a 400) ends that request with
    RequestFailedError; the engine thread lives on and serves the next request."""
    from k3serve.engine.outputs import RequestFailedError

    engine = make_async_engine()

    def broken(constraint: StructuredOutputsParams) -> None:
        raise MemoryError("the compiler ran out")

    engine.engine.structured_outputs.compiler.on_compile = broken

    async def run():
        with pytest.raises(RequestFailedError, match="compile failed"):
            await collect(engine.generate(GenerateRequest("broken", [1, 2, 3], constrained())))
        engine.engine.structured_outputs.compiler.on_compile = None
        return await collect(engine.generate(GenerateRequest("next", [1, 2, 3], constrained())))

    deltas = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert re.fullmatch(REGEX, "".join(d.new_text for d in deltas)) and deltas[-1].finish_reason == "stop"
