"""The disaggregated ingress's admission queue: requests wait here, in arrival order, for room on a decode replica.

A disaggregated request reserves its decode room before its prefill runs. When every decode replica is full it
waits here instead of failing (as the colocated scheduler queues it, and SGLang's decode prealloc queue): up to
`max_queued` requests (more: 503 at once), each at most `timeout_seconds` (then 503); a cancelled one leaves
holding nothing. Only the head tries again, when woken (a request admitted here ended, or the stats refresh),
so a large prompt at the head is not overtaken by small ones; arrivals try at once while nobody is queued. The
decode replica decides each try alone, so at most the free room is granted. The queue's states and its
ordering argument: docs/design/admission.md.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, TypeVar

from k3serve.cluster.errors import EngineOverloadedError

T = TypeVar("T")


@dataclass(eq=False)
class _Entry:
    """A request in admission, from its arrival until it is admitted or leaves."""

    wakes_before: int  # wake() calls before it arrived (its first try began then)
    queued: bool = False  # its first try was refused, or not made: it waits its turn
    woken: asyncio.Event = field(default_factory=asyncio.Event)


class AdmissionQueue(Generic[T]):
    """FIFO admission under two bounds: `max_queued` waiting requests (None: no bound; 0: never
    wait) and `timeout_seconds` of waiting each (None: no limit). `on_change(num_waiting)` is
    called whenever the number waiting changes (the ingress gauge); `on_wait(seconds)` once for
    each request admitted or queued, with its time from arrival to its admission or to leaving
    the queue without one (timed out, cancelled, failed): the queue-time histogram must see the
    requests that gave up as well, most of all when the queue is long."""

    def __init__(self, max_queued: int | None = None, timeout_seconds: float | None = None,
                 on_change: Callable[[int], None] | None = None,
                 on_wait: Callable[[float], None] | None = None) -> None:
        if max_queued is not None and max_queued < 0:
            raise ValueError(f"max_queued must be >= 0 or None, got {max_queued}")
        if timeout_seconds is not None and timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0 or None, got {timeout_seconds}")
        self.max_queued, self.timeout_seconds = max_queued, timeout_seconds
        self._on_change, self._on_wait = on_change, on_wait
        self._line: list[_Entry] = []  # every request in admission, by arrival; [0] is the head
        self._num_queued = 0  # those of the line that wait their turn (the others are in their first try)
        self._num_wakes = 0  # wake() calls so far

    @property
    def num_waiting(self) -> int:
        return self._num_queued

    def wake(self) -> None:
        """Room may have opened: the head tries again (once, however many wakes come meanwhile)."""
        self._num_wakes += 1
        if self._line:
            self._line[0].woken.set()

    async def admit(self, try_admit: Callable[[], Awaitable[T | None]], what: str = "the request") -> T:
        """`try_admit()`'s result, once it is not None (None: no room now). It is called at once if
        `_may_try_at_once`, else (and after a refused first try) whenever this request is the head
        and is woken. `what` names the request in the 503s."""
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        entry = _Entry(self._num_wakes)
        try_now = self._may_try_at_once()
        self._line.append(entry)
        admitted = None
        try:
            if try_now:
                admitted = await try_admit()
                if admitted is not None:
                    return admitted
            self._queue(entry, what)
            deadline = None if self.timeout_seconds is None else loop.time() + self.timeout_seconds
            while True:
                await self._until_woken(entry, deadline, what)
                entry.woken.clear()  # a wake during the try below makes it try once more
                admitted = await try_admit()
                if admitted is not None:
                    return admitted
        finally:
            was_head = self._line[0] is entry
            self._line.remove(entry)
            if entry.queued:
                self._num_queued -= 1
                self._changed()
            if self._on_wait is not None and (admitted is not None or entry.queued):
                self._on_wait(loop.time() - arrived)
            if self._line and (admitted is not None or was_head):
                self._line[0].woken.set()  # the next head tries at once: room may be left, or it is its turn

    def _may_try_at_once(self) -> bool:
        """An arrival tries before it queues when nobody is queued and every try ahead of it began
        after the last wake: each of those saw the room there is, so trying beside them overtakes
        no request that was refused just before room opened. With no queue (max_queued 0) there is
        no order to keep."""
        if self.max_queued == 0:
            return True
        return self._num_queued == 0 and (not self._line or self._line[0].wakes_before == self._num_wakes)

    def _queue(self, entry: _Entry, what: str) -> None:
        """`entry` waits its turn, or gets 503 at once when `max_queued` already wait."""
        if self.max_queued is not None and self._num_queued >= self.max_queued:
            ahead = f" and {self._num_queued} requests are already waiting" if self._num_queued else ""
            raise EngineOverloadedError(f"no decode replica has room for {what} now{ahead}; retry later")
        entry.queued = True
        self._num_queued += 1
        self._changed()

    async def _until_woken(self, entry: _Entry, deadline: float | None, what: str) -> None:
        if entry.woken.is_set():
            return
        left = None if deadline is None else deadline - asyncio.get_running_loop().time()
        try:
            if left is not None and left <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait_for(entry.woken.wait(), left)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise EngineOverloadedError(f"{what} waited {self.timeout_seconds:g} s for room on a decode replica "
                                        "(queue_timeout_seconds); retry later") from None

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self._num_queued)
