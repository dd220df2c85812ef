"""The handoff seam (`engine/kv_handoff.py`) over a real engine (the tiny model, one rank):

- its engine-thread methods refuse any other thread, and run inside `call` / `submit`;
- a prompt that finished at its boundary (the prefill case: max_tokens 1) is reported once, with its blocks and
  slot, before the engine frees them: what the callee pins outlives the request until unpinned; a request that
  ran past its prompt, or was aborted, is not reported;
- a reservation holds its blocks and slot until `cancel`, or until the request `adopt` continued ends.
"""

from __future__ import annotations

import asyncio

import pytest

from k3serve.engine.config import EngineArgs
from k3serve.engine.kv_handoff import BoundaryState, KVHandoff
from k3serve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)

BLOCK_SIZE = 16
PROMPT = list(range(20, 60))  # 40 tokens: 3 blocks


@pytest.fixture
def make_handoff(tiny_checkpoint):
    built: list[KVHandoff] = []

    def make(**hooks) -> KVHandoff:
        args = EngineArgs(model=str(tiny_checkpoint), block_size=BLOCK_SIZE, max_model_len=512,
                          cache_memory_bytes=64 << 20)
        built.append(KVHandoff(args, **hooks))
        return built[-1]

    yield make
    for handoff in built:
        handoff.shutdown()


def usage(handoff: KVHandoff) -> tuple[float, float]:
    """(block usage, slot usage): pins and reservations count."""
    stats = handoff.submit(handoff.stats).result(timeout=10)
    return stats.block_usage, stats.slot_usage


async def run(handoff: KVHandoff, request_id: str, params: SamplingParams) -> list[int]:
    return [t async for d in handoff.generate(request_id, PROMPT, params) for t in d.new_token_ids]


def test_engine_thread_methods_refuse_any_other_thread(make_handoff) -> None:
    handoff = make_handoff()
    state = BoundaryState("r", (0,), 0, 1)
    calls = [handoff.stats, lambda: handoff.has_request("r"), lambda: handoff.reserve("r", 8),
             lambda: handoff.cancel(state), lambda: handoff.on_all_ranks("x", (), lambda: 0)]
    for call in calls:
        with pytest.raises(RuntimeError, match="runs on the engine thread only"):
            call()
    assert handoff.submit(lambda: handoff.on_all_ranks("x", (), lambda: 7)).result(timeout=10) == [7]
    assert asyncio.run(handoff.call(lambda: handoff.has_request("r"))) is False


def test_a_prompt_finished_at_its_boundary_is_reported_before_its_state_is_freed(make_handoff) -> None:
    done: list[BoundaryState] = []

    def hold(state: BoundaryState) -> None:  # what a prefill worker does: pin it past the request's end
        handoff.pins.pin(state.block_ids, [state.slot_id])
        done.append(state)

    handoff = make_handoff(on_prompt_done=hold)
    assert len(asyncio.run(run(handoff, "first-token", SamplingParams(max_tokens=1)))) == 1
    [state] = done
    assert (state.request_id, state.num_tokens, len(state.block_ids)) == ("first-token", len(PROMPT), 3)
    assert usage(handoff) > (0.0, 0.0), "the pinned blocks and slot outlive the request"
    handoff.submit(lambda: handoff.pins.unpin(state.block_ids, [state.slot_id])).result(timeout=10)
    assert usage(handoff) == (0.0, 0.0)

    asyncio.run(run(handoff, "past-its-prompt", SamplingParams(max_tokens=3, ignore_eos=True)))

    async def aborted() -> None:
        stream = handoff.generate("aborted", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        await handoff.abort("aborted")
        async for _ in stream:
            pass

    asyncio.run(aborted())
    assert [s.request_id for s in done] == ["first-token"]
    assert usage(handoff) == (0.0, 0.0)


def test_a_reservation_is_freed_by_cancel_and_owned_by_the_request_it_adopts(make_handoff) -> None:
    aborted: list[str] = []
    handoff = make_handoff(on_abort=aborted.append)
    state = handoff.submit(lambda: handoff.reserve("cancelled", len(PROMPT))).result(timeout=10)
    assert (len(state.block_ids), state.num_tokens) == (3, len(PROMPT))
    assert usage(handoff) > (0.0, 0.0)
    handoff.submit(lambda: handoff.cancel(state)).result(timeout=10)
    assert usage(handoff) == (0.0, 0.0)

    async def adopted() -> list[int]:
        stream = handoff.stream("adopted")

        def adopt() -> None:
            reservation = handoff.reserve("adopted", len(PROMPT))
            handoff.adopt(reservation, PROMPT, 7, SamplingParams(max_tokens=3, ignore_eos=True))

        await handoff.call(adopt)
        return [t async for d in stream for t in d.new_token_ids]

    tokens = asyncio.run(adopted())
    assert len(tokens) == 3 and tokens[0] == 7  # continued from the handed-over first token
    assert usage(handoff) == (0.0, 0.0)
    asyncio.run(handoff.abort("unknown"))
    handoff.submit(lambda: None).result(timeout=10)  # the abort ran before this
    assert aborted == ["unknown"]
