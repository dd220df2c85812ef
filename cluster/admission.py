"""The disaggregated ingress's admission queue: requests wait here, in arrival order, for room on a
decode replica.

A disaggregated request reserves its decode room before its prefill runs (the prefill writes the
prompt's state into that reservation). When every decode replica is full, the request waits here
instead of failing, as the colocated engine's scheduler queues it and as SGLang's decode server
keeps a FIFO "prealloc queue" that stops at the first request that does not fit
(python/sglang/srt/disaggregation/decode.py, `DecodePreallocQueue.pop_preallocated`):

    arrival ──queue empty?──yes──> try ──admitted──> prefill, decode
                  │ no              │ every replica full
                  v                 v
          [ head  w2  w3 ... ] <── joins in arrival order; more than `max_queued`: 503 at once
            │
            └─ tries again when woken: a request this ingress admitted ended, or the periodic stats
               refresh (other ingresses, expired leases, a restarted replica); admitted: the next
               head tries at once. Waited `timeout_seconds`: 503. Cancelled: leaves, holding nothing.

Only the head tries, so a large prompt at the head is not overtaken by small ones behind it
(head-of-line blocking is the price, as in SGLang). Arrivals that find the queue empty try at once
and concurrently, so a burst spreads over the replicas as it did without a queue; one whose try
fails joins the queue by its arrival number, so it can be overtaken only by an arrival that was
trying at the same time.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, TypeVar

from k3serve.cluster.api.errors import EngineOverloadedError

T = TypeVar("T")


@dataclass(order=True)
class _Waiter:
    arrival: int
    woken: asyncio.Event = field(compare=False, default_factory=asyncio.Event)


class AdmissionQueue(Generic[T]):
    """FIFO admission under two bounds: `max_queued` waiting requests (None: no bound; 0: never
    wait) and `timeout_seconds` of waiting each (None: no limit). `on_change(num_waiting)` is
    called whenever the number waiting changes (the ingress gauge)."""

    def __init__(self, max_queued: int | None = None, timeout_seconds: float | None = None,
                 on_change: Callable[[int], None] | None = None) -> None:
        if max_queued is not None and max_queued < 0:
            raise ValueError(f"max_queued must be >= 0 or None, got {max_queued}")
        if timeout_seconds is not None and timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0 or None, got {timeout_seconds}")
        self.max_queued, self.timeout_seconds = max_queued, timeout_seconds
        self._on_change = on_change
        self._waiting: list[_Waiter] = []  # by arrival; [0] is the head
        self._arrivals = itertools.count()
        self._num_wakes = 0  # wake() calls so far: a try that missed one tries again

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def wake(self) -> None:
        """Room may have opened: the head tries again (once, however many wakes come meanwhile)."""
        self._num_wakes += 1
        if self._waiting:
            self._waiting[0].woken.set()

    async def admit(self, try_admit: Callable[[], Awaitable[T | None]], what: str = "the request") -> T:
        """`try_admit()`'s result, once it is not None (None: no room now). It is called at once if
        nobody waits, else (and after a failed first try) whenever this request is the head and is
        woken. `what` names the request in the 503s."""
        arrival = next(self._arrivals)
        wakes = self._num_wakes
        if not self._waiting:
            admitted = await try_admit()
            if admitted is not None:
                return admitted
        if self.max_queued is not None and len(self._waiting) >= self.max_queued:
            ahead = f" and {len(self._waiting)} requests are already waiting" if self._waiting else ""
            raise EngineOverloadedError(f"no decode replica has room for {what} now{ahead}; retry later")
        waiter = _Waiter(arrival)
        bisect.insort(self._waiting, waiter)
        self._changed()
        if self._waiting[0] is waiter and self._num_wakes != wakes:
            waiter.woken.set()  # room opened while it tried (or before it joined): try again
        deadline = None if self.timeout_seconds is None else asyncio.get_running_loop().time() + self.timeout_seconds
        try:
            while True:
                await self._until_woken(waiter, deadline, what)
                waiter.woken.clear()  # a wake during the try below makes it try once more
                admitted = await try_admit()
                if admitted is not None:
                    return admitted
        finally:
            self._waiting.remove(waiter)
            self._changed()
            if self._waiting:
                self._waiting[0].woken.set()  # the new head (or the next after an admission) tries at once

    async def _until_woken(self, waiter: _Waiter, deadline: float | None, what: str) -> None:
        if waiter.woken.is_set():
            return
        left = None if deadline is None else deadline - asyncio.get_running_loop().time()
        try:
            if left is not None and left <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait_for(waiter.woken.wait(), left)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise EngineOverloadedError(f"{what} waited {self.timeout_seconds:g} s for room on a decode replica "
                                        "(queue_timeout_seconds); retry later") from None

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._waiting))
