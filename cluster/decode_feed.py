"""A router's one delta stream from one decode replica, split back into per-request streams (one cross-process
message per engine step, not one per token per request):

    feed = DecodeFeed(replica)
    link = await feed.link()                    # the live feed, opened on first use
    deltas = link.follow(rid)                   # registered before admit: nothing is missed
    reservation = await replica.admit(rid, prompt, params, link.feed_id)
    HandoffTarget(link.addresses, reservation)  # where prefill pushes the prompt's state
    async for delta in deltas: ...              # this request's deltas, in order; deltas.close()

A slow consumer only grows its own queue; the feed never waits for it. A feed that breaks fails every request
on it with `ReplicaDiedError`; the next `link()` opens a new one. Why one feed, and why its addresses are
read once it is open: docs/design/decode_feed.md.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

from k3serve.cluster.errors import ReplicaDiedError
from k3serve.cluster.replicas import DecodeReplica

if TYPE_CHECKING:
    from k3serve.engine.stream_types import Item
    from k3serve.engine.outputs import RequestDelta


class DecodeFeed:
    """Hands out the live link to one decode replica's feed, replacing a broken one."""

    def __init__(self, replica: DecodeReplica) -> None:
        self.replica = replica
        self._link: FeedLink | None = None

    async def link(self) -> "FeedLink":
        """The open feed (opened now if there is none, or the last one broke); raises
        ReplicaDiedError if the replica cannot open one."""
        if self._link is None or self._link.error is not None:
            self._link = FeedLink(self.replica)
        link = self._link
        await asyncio.shield(link.opened)
        return link

    def close(self) -> None:
        if self._link is not None:
            self._link.close()


class FeedLink:
    """One open feed: a task reads its batches and puts each item into its request's queue."""

    def __init__(self, replica: DecodeReplica) -> None:
        self.replica = replica
        self.feed_id = uuid.uuid4().hex
        self.error: BaseException | None = None  # why the feed ended; set once
        self.addresses: tuple[str, ...] = ()  # every rank's control address, rank order; set once open
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._reader = asyncio.create_task(self._read(), name=f"decode-feed-{replica.name}")

    def follow(self, request_id: str) -> "RequestDeltas":
        """Route `request_id`'s deltas to the returned stream from now on."""
        if self.error is not None:
            raise self.error
        if request_id in self._queues:
            raise ValueError(f"duplicate request_id {request_id!r}")
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[request_id] = queue
        return RequestDeltas(self, request_id, queue)

    def fail(self, error: BaseException) -> None:
        """End the feed here: every request on it raises `error`, later deltas go nowhere."""
        if self.error is not None:
            return
        self.error = error
        if not self.opened.done():
            self.opened.set_exception(error)
            self.opened.exception()  # retrieved: no "never retrieved" warning when nobody waits
        for request_id, queue in self._queues.items():
            lost = ReplicaDiedError(f"{error} (request {request_id} is lost)")
            lost.__cause__ = error
            queue.put_nowait(lost)
        self._queues.clear()
        self._reader.cancel()

    def close(self) -> None:
        self.fail(ReplicaDiedError(f"the router closed its feed from decode replica {self.replica.name}"))

    def _forget(self, request_id: str, queue: asyncio.Queue) -> None:
        if self._queues.get(request_id) is queue:
            del self._queues[request_id]

    async def _read(self) -> None:
        name = self.replica.name
        try:
            async for batch in self.replica.feed(self.feed_id):
                if not self.opened.done():
                    self.addresses = await self.replica.addresses()  # of the process serving this feed
                    self.opened.set_result(None)
                for request_id, item in batch:
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(item)
            error: BaseException = ReplicaDiedError(f"decode replica {name} ended its feed")
        except asyncio.CancelledError:  # fail() or close() (then a no-op), or a cancel from outside
            self.fail(ReplicaDiedError(f"feed from decode replica {name} was cancelled"))
            raise
        except ReplicaDiedError as e:
            error = e
        except Exception as e:  # any other way the feed breaks: its requests must not hang
            error = ReplicaDiedError(f"decode replica {name}: feed failed: {e!r}")
        self.fail(error)


class RequestDeltas:
    """One request's deltas from a feed, in order, until its last (finished) delta."""

    def __init__(self, link: FeedLink, request_id: str, queue: asyncio.Queue["Item"]) -> None:
        self._link, self._request_id, self._queue = link, request_id, queue

    def __aiter__(self) -> "RequestDeltas":
        return self

    async def __anext__(self) -> "RequestDelta":
        if self._queue is None:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.close()
        return item

    def close(self) -> None:
        """Stop routing this request's deltas here (idempotent)."""
        if self._queue is not None:
            self._link._forget(self._request_id, self._queue)
            self._queue = None
