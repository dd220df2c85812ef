"""One HTTP request as several engine requests, one per choice (the `n` samples of each prompt of a batch).

vLLM splits `n > 1` into child requests inside its engine (`ParentRequest`) and a batch of prompts into one engine
request per prompt in its OpenAI server; k3serve does both here, at the ingress, so that each engine request is an
ordinary one (n = 1) that any `EngineClient`, the disaggregated router included, serves as it is.

    start       opens every engine request and waits until each has sent its first delta, so that an error any
                of them raises before generating (bad value, overload, dead engine) fails the whole request with
                its own status rather than a 200 stream;
    async for   then (choice index, delta) in arrival order, choices interleaved, until every one has finished;
                the first error of any choice is raised;
    close       aborts every engine request that has not finished and closes every stream, shielded from the
                cancellation that is usually the reason it runs: after a failed choice or a client gone, nothing
                keeps running. Idempotent.

A request of one choice (almost all of them) reads its engine stream directly, in the reader's task. With several,
a pump task per engine request reads its stream, so the choices advance independently of each other, into a queue
with room for one delta a choice: a pump whose delta finds it full waits, and so stops reading its stream, until the
reader (the client) catches up; what the engine makes meanwhile waits in the engine's own stream. `on_delta` sees
each delta as it is read from its engine stream (TTFT and ITL are timed there), before any formatting.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, Sequence

import anyio

from k3serve.engine.outputs import RequestDelta
from k3serve.engine.stream_types import GenerateRequest

from .engine_client import EngineClient

logger = logging.getLogger(__name__)


class FanOut:
    def __init__(self, client: EngineClient, requests: Sequence[GenerateRequest],
                 on_delta: Callable[[int, RequestDelta], None]) -> None:
        self.client = client
        self.requests = list(requests)  # choice index -> its engine request
        self.on_delta = on_delta
        self._streams: list[AsyncIterator[RequestDelta]] = []
        self._finished = [False] * len(self.requests)  # the engine request has sent its finished delta
        self._num_unread = len(self.requests)  # choices whose finished delta the reader has not had yet
        self._closed = False
        self._direct = len(self.requests) == 1  # read the one stream in the reader's task, no pump
        self._first: RequestDelta | None = None  # direct: the first delta, read by `start`, until the reader has it
        self._pumps: list[asyncio.Task] = []
        self._arrived: asyncio.Queue[tuple[int, RequestDelta | Exception]] = asyncio.Queue(maxsize=len(self.requests))
        self._num_unstarted = len(self.requests)  # choices without a first delta yet
        self._started = asyncio.Event()  # every choice has a first delta, or one failed before its first
        self._start_error: Exception | None = None

    async def start(self) -> None:
        try:
            if self._direct:
                self._streams.append(self.client.generate(self.requests[0]))
                self._first = await self._read(0)
                return
            for index, request in enumerate(self.requests):
                self._streams.append(self.client.generate(request))
                self._pumps.append(asyncio.create_task(self._pump(index)))
            await self._started.wait()
            if self._start_error is not None:
                raise self._start_error
        except BaseException:
            await self.close()
            raise

    def __aiter__(self) -> "FanOut":
        return self

    async def __anext__(self) -> tuple[int, RequestDelta]:
        if self._num_unread == 0:
            raise StopAsyncIteration
        if self._direct:
            index, item, self._first = 0, self._first, None
            if item is None:
                item = await self._read(0)
        else:
            index, item = await self._arrived.get()
            if isinstance(item, Exception):
                raise item
        if item.finished:
            self._num_unread -= 1
        return index, item

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for pump in self._pumps:
                pump.cancel()  # a pump inside its stream: the stream's own cleanup runs now
            await asyncio.gather(*self._pumps, return_exceptions=True)
            await asyncio.gather(*(self._close_one(i) for i in range(len(self._streams))))

    async def _read(self, index: int) -> RequestDelta:
        """The next delta of choice `index`'s stream (shown to `on_delta`); an error if it ends unfinished."""
        try:
            delta = await anext(self._streams[index])
        except StopAsyncIteration:
            raise RuntimeError(f"{self.requests[index].request_id}: the backend ended the stream unfinished") from None
        self.on_delta(index, delta)
        self._finished[index] = delta.finished
        return delta

    async def _pump(self, index: int) -> None:
        started = False
        try:
            while not self._finished[index]:
                delta = await self._read(index)
                if not started:
                    started = True
                    self._num_unstarted -= 1
                    if self._num_unstarted == 0:
                        self._started.set()
                await self._arrived.put((index, delta))  # waits while the reader is behind
        except Exception as e:
            if not started and self._start_error is None:
                self._start_error = e
                self._started.set()
            await self._arrived.put((index, e))

    async def _close_one(self, index: int) -> None:
        request_id = self.requests[index].request_id
        try:
            if not self._finished[index]:
                await self.client.abort(request_id)
            aclose = getattr(self._streams[index], "aclose", None)
            if aclose is not None:
                await aclose()
        except Exception:
            logger.exception("%s: cleanup failed", request_id)
