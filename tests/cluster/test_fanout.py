"""FanOut (cluster/api/fanout.py) over a backend far ahead of its reader: what it reads ahead is bounded (a slow
client never makes the ingress buffer a whole output), the one choice of most requests is read only as the reader
asks, every choice's deltas still all arrive in order, and closing at any point aborts and closes every unfinished
choice. The ingress's end-to-end cleanup (client gone, failing choice, drain) is in test_api.py."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import AsyncIterator

import pytest

from k3serve.cluster.api.fanout import FanOut
from k3serve.engine.outputs import RequestDelta
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest

pytestmark = pytest.mark.anyio

NUM_DELTAS = 200


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ReadyEngine:
    """An EngineClient whose requests have their whole output ready, a delta a loop turn (an engine far ahead of
    its client). `first_after` delays a request's first delta by that many turns; `fail_first` makes it raise
    instead. It keeps the requests aborted and the streams closed."""

    def __init__(self, first_after: dict[str, int] | None = None, fail_first: set[str] = frozenset()) -> None:
        self.first_after = first_after or {}
        self.fail_first = fail_first
        self.aborted: list[str] = []
        self.closed: list[str] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        rid = request.request_id
        try:
            for _ in range(self.first_after.get(rid, 0)):
                await asyncio.sleep(0)
            if rid in self.fail_first:
                raise ValueError(f"{rid} refused")
            for n in range(1, NUM_DELTAS + 1):
                await asyncio.sleep(0)
                last = n == NUM_DELTAS
                yield RequestDelta(rid, [n], f"{n} ", finished=last, finish_reason="length" if last else None,
                                   logprobs=None, num_prompt_tokens=3, num_output_tokens=n)
        finally:
            self.closed.append(rid)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def fan_out(engine: ReadyEngine, num_choices: int) -> tuple[FanOut, Counter]:
    """A FanOut of `num_choices` requests, and how many deltas of each choice it has read from the engine."""
    num_read: Counter = Counter()
    requests = [GenerateRequest(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(num_choices)]
    return FanOut(engine, requests, lambda index, delta: num_read.update([index])), num_read


async def let_the_engine_run() -> None:
    for _ in range(3 * NUM_DELTAS):
        await asyncio.sleep(0)


async def test_several_choices_read_ahead_at_most_two_deltas_a_choice():
    """Room for one delta a choice in the queue, and one more a pump holds while it waits: not the whole output."""
    fan, num_read = fan_out(ReadyEngine(), 3)
    await fan.start()
    await anext(fan)
    await let_the_engine_run()
    assert sum(num_read.values()) <= 1 + 2 * 3, num_read
    await fan.close()


async def test_one_choice_is_read_only_as_the_reader_asks():
    fan, num_read = fan_out(ReadyEngine(), 1)
    await fan.start()
    assert num_read[0] == 1  # start waits for the first delta
    got = [await anext(fan) for _ in range(5)]
    await let_the_engine_run()
    assert num_read[0] == 5 and [delta.new_text for _, delta in got] == ["1 ", "2 ", "3 ", "4 ", "5 "]
    await fan.close()


@pytest.mark.parametrize("num_choices", [1, 3])
async def test_a_slow_reader_gets_every_delta_of_every_choice_in_order(num_choices):
    engine = ReadyEngine()
    fan, _ = fan_out(engine, num_choices)
    await fan.start()
    texts: dict[int, list[str]] = {i: [] for i in range(num_choices)}
    async for index, delta in fan:
        texts[index].append(delta.new_text)
        assert delta.finished == (len(texts[index]) == NUM_DELTAS)
        for _ in range(5):  # a slow client
            await asyncio.sleep(0)
    await fan.close()
    assert all(t == [f"{n} " for n in range(1, NUM_DELTAS + 1)] for t in texts.values())
    assert engine.aborted == []  # all finished: nothing to abort


@pytest.mark.parametrize("num_choices", [1, 3])
async def test_closing_mid_stream_aborts_and_closes_every_choice(num_choices):
    """With the pumps waiting on a full queue (or the one stream between two reads)."""
    engine = ReadyEngine()
    fan, _ = fan_out(engine, num_choices)
    await fan.start()
    await anext(fan)
    await let_the_engine_run()
    await fan.close()
    ids = {f"r{i}" for i in range(num_choices)}
    assert set(engine.aborted) == ids and set(engine.closed) == ids
    assert all(pump.done() for pump in fan._pumps)


async def test_a_late_first_delta_does_not_wait_behind_a_full_queue():
    """Choices 0 and 1 fill the queue before choice 2 sends its first delta: start still returns."""
    fan, num_read = fan_out(ReadyEngine(first_after={"r2": 2 * NUM_DELTAS}), 3)
    await asyncio.wait_for(fan.start(), 5)
    assert num_read[2] == 1
    await fan.close()


async def test_a_choice_failing_before_its_first_delta_fails_the_start_and_aborts_all():
    engine = ReadyEngine(first_after={"r2": 2 * NUM_DELTAS}, fail_first={"r2"})
    fan, _ = fan_out(engine, 3)
    with pytest.raises(ValueError, match="r2 refused"):
        await asyncio.wait_for(fan.start(), 5)
    assert set(engine.aborted) == {"r0", "r1", "r2"} and set(engine.closed) == {"r0", "r1", "r2"}
