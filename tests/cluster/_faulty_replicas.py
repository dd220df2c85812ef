"""Real in-process workers behind replica handles that fail as Ray actors do.

    KillableDecode(worker)   kill(): its feeds end with ReplicaDiedError at once (Ray cuts a dead actor's
                             streams), the worker shuts down, every later call raises ReplicaDiedError;
                             restart(make): a new worker under the same name, as Ray restarts the actor
    KillablePrefill(worker)  the same for a prefill worker: calls in flight raise ReplicaDiedError
    FlakyPrefill(worker)     before(replica, target): a hook run before each prefill call; after_handoff:
                             a number of calls that run in full (writes landed, decode adopted) and then
                             raise AmbiguousFailure, as a reply lost with its actor (ActorUnavailableError)
    wait_decode_idle(worker) until a decode worker holds no request, reservation, block or slot
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from k3serve.cluster.errors import ReplicaDiedError
from k3serve.decode.worker import DecodeWorker
from k3serve.prefill.messages import HandoffTarget
from k3serve.prefill.worker import PrefillWorker


class AmbiguousFailure(RuntimeError):
    """The call's reply was lost: whatever it did may have happened."""


class _Killable:
    """An in-process worker that can be killed (its calls then raise ReplicaDiedError, as a dead actor's) and
    restarted from a new worker."""

    pool = ""

    def __init__(self, worker) -> None:
        self.worker, self.name = worker, worker.name
        self.killed = asyncio.Event()

    async def kill(self) -> None:
        self.killed.set()
        await asyncio.to_thread(self.worker.shutdown)

    async def restart(self, make: Callable[[], Any]) -> None:
        self.worker = await asyncio.to_thread(make)
        self.killed.clear()

    def _alive(self) -> None:
        if self.killed.is_set():
            raise ReplicaDiedError(f"{self.pool} replica {self.name} died")


class KillableDecode(_Killable):
    pool = "decode"

    async def feed(self, feed_id: str):
        self._alive()
        batches = self.worker.feed(feed_id).__aiter__()
        try:
            while True:
                next_batch = asyncio.ensure_future(batches.__anext__())
                killed = asyncio.ensure_future(self.killed.wait())
                await asyncio.wait([next_batch, killed], return_when=asyncio.FIRST_COMPLETED)
                if killed.done():
                    next_batch.cancel()  # the worker's feed ends (its requests aborted there) before this one
                    await asyncio.wait([next_batch])
                    raise ReplicaDiedError(f"decode replica {self.name} died")
                killed.cancel()
                yield next_batch.result()
        finally:  # a dead worker's feed ends too (nothing is left suspended that holds the worker)
            await batches.aclose()

    async def addresses(self):
        self._alive()
        return await self.worker.addresses()

    async def admit(self, *args):
        self._alive()
        return await self.worker.admit(*args)

    async def abort_request(self, request_id: str) -> None:
        self._alive()
        await self.worker.abort_request(request_id)

    async def stats(self):
        self._alive()
        return await self.worker.stats()

    async def metrics_text(self) -> str:
        self._alive()
        return await self.worker.metrics_text()


class KillablePrefill(_Killable):
    pool = "prefill"

    async def prefill(self, request_id, prompt_token_ids, params, target: HandoffTarget):
        self._alive()
        call = asyncio.ensure_future(self.worker.prefill(request_id, prompt_token_ids, params, target))
        killed = asyncio.ensure_future(self.killed.wait())
        try:
            await asyncio.wait([call, killed], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller left: so does the call
            call.cancel()
            raise
        finally:
            killed.cancel()
        if not call.done():
            call.cancel()
            call = None  # the error's traceback (kept by log records) must not keep the dead worker
            raise ReplicaDiedError(f"prefill replica {self.name} died")
        return call.result()

    async def abort(self, request_id: str) -> None:
        self._alive()
        await self.worker.abort(request_id)

    async def stats(self):
        self._alive()
        return await self.worker.stats()

    async def metrics_text(self) -> str:
        self._alive()
        return await self.worker.metrics_text()


Hook = Callable[["FlakyPrefill", HandoffTarget], Awaitable[None]]


class FlakyPrefill:
    def __init__(self, worker: PrefillWorker, name: str | None = None) -> None:
        self.worker, self.name = worker, name or worker.name
        self.targets: list[HandoffTarget] = []  # every call's target, in order
        self.before: Hook | None = None
        self.after_handoff = 0  # calls left that hand off in full and then raise AmbiguousFailure

    async def prefill(self, request_id, prompt_token_ids, params, target: HandoffTarget):
        self.targets.append(target)
        if self.before is not None:
            await self.before(self, target)
        result = await self.worker.prefill(request_id, prompt_token_ids, params, target)
        if self.after_handoff:
            self.after_handoff -= 1
            raise AmbiguousFailure(f"prefill replica {self.name}: the reply to {request_id} was lost")
        return result

    async def abort(self, request_id: str) -> None:
        await self.worker.abort(request_id)

    async def stats(self):
        return await self.worker.stats()

    async def metrics_text(self) -> str:
        return await self.worker.metrics_text()


async def wait_decode_idle(decode: DecodeWorker, deadline_s: float = 10.0) -> None:
    idle = None
    for _ in range(int(deadline_s / 0.05)):
        s = await decode.stats()
        idle = (s.num_running, s.num_waiting, s.num_reserved, s.block_usage, s.slot_usage)
        if idle == (0, 0, 0, 0.0, 0.0):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"decode pool not idle: (running, waiting, reserved, blocks, slots) = {idle}")
