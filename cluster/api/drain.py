"""`Drain`: the ingress's graceful stop (`k3serve serve` on SIGTERM), and `DrainGate`, the ASGI middleware that
applies it.

Once `begin()` is called, every new request but /health and /metrics is answered 503 "server is shutting down"
(with `Connection: close`) and /health answers 503 (app.py reads `draining`): a load balancer stops routing here
while the requests already in flight run to their end. `wait_idle()` waits for them; `abort()` ends those still
running: each one's handler is cancelled, which aborts its engine requests (the routes' own cleanup: the stream's,
the disconnect watcher's), and its client gets a clear end rather than a cut connection: a stream that began gets an
error event and [DONE], a response not begun the 503.

Each request's handler runs in a task of its own so that `abort()` can cancel it and the gate, not cancelled, can
still answer. A pure ASGI middleware, as auth.py's, so the routes keep their receive channel.

A request `abort()` cuts counts once, as a 503, stream or not: `abort()` counts it before it cancels the handler,
with the count the route named (`count_cut_with`: its RequestTimer, whose later ends then count nothing, the
cancelled stream's "client gone" 499 among them), else the gate's own 503 count.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, error_body, error_response

SHUTTING_DOWN = HTTPStatus.SERVICE_UNAVAILABLE
_ALWAYS_OPEN = ("/health", "/metrics")  # the probe answers 503 itself; Prometheus reads the last counts
_REFUSAL = APIError(SHUTTING_DOWN, "server is shutting down: retry on another replica")
# No Retry-After: this replica will not take the request again. Connection: close moves a keep-alive client
# (and its retry) off it.
_CLOSE = {"Connection": "close"}
_STREAM_END = f"data: {json.dumps(error_body(_REFUSAL.status, _REFUSAL.message))}\n\ndata: [DONE]\n\n".encode()
_COUNT_CUT = "k3serve.count_drain_cut"  # scope key: how `abort()` counts this request's cut


def count_cut_with(scope: Scope, count: Callable[[int], None]) -> None:
    """Have `abort()` count this request's cut as `count(503)` (in place of the gate's count), called before the
    handler is cancelled: so a count that acts once (RequestTimer.fail) is the 503, not what the cancellation's
    cleanup would count (a stream's "client gone" 499; nothing for a response not begun)."""
    scope[_COUNT_CUT] = count


class Drain:
    """Whether the ingress drains, and the handlers of the requests in flight."""

    def __init__(self) -> None:
        self.draining = False
        self._running: dict[asyncio.Task, Scope] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def begin(self) -> None:
        """Refuse new requests from now on; those in flight run on."""
        self.draining = True

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        await self._idle.wait()

    async def abort(self, timeout_s: float) -> None:
        """Cancel every request in flight, each counted as a 503 first (`count_cut_with`), and wait (up to
        `timeout_s`) until each one's client has had its end."""
        for task, scope in list(self._running.items()):
            if not task.done():  # a finished one is counted already, and waits only for its gate's removal
                scope[_COUNT_CUT](SHUTTING_DOWN)
                task.cancel()
        try:
            await asyncio.wait_for(self.wait_idle(), timeout_s)
        except asyncio.TimeoutError:
            pass  # uvicorn's own graceful-shutdown timeout cancels what is left

    def _add(self, task: asyncio.Task, scope: Scope) -> None:
        self._running[task] = scope
        self._idle.clear()

    def _remove(self, task: asyncio.Task) -> None:
        self._running.pop(task, None)
        if not self._running:
            self._idle.set()


class DrainGate:
    """Refuses new requests while `drain` drains (`on_refused` counts each 503); runs the others as `drain`'s
    in-flight tasks, and answers for any that `drain.abort()` cancels."""

    def __init__(self, app: ASGIApp, drain: Drain, on_refused: Callable[[int], None]) -> None:
        self.app, self.drain, self._on_refused = app, drain, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _ALWAYS_OPEN:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            self._on_refused(SHUTTING_DOWN)
            await _refuse(scope, receive, send)
            return
        reply = _Reply(send)

        def count_cut(status: int) -> None:  # a route without a timer of its own (/v1/models, a body being read)
            if not reply.finished:
                self._on_refused(status)

        count_cut_with(scope, count_cut)
        task = asyncio.ensure_future(self.app(scope, receive, reply))
        self.drain._add(task, scope)
        try:
            await asyncio.wait({task})  # not `await task`: a cancelled handler must not cancel the gate
            if task.cancelled():  # by drain.abort(): tell the client
                await reply.end(scope, receive)
            else:
                task.result()  # the app's own errors propagate as before
        finally:
            if not task.done():  # the gate itself was cancelled (uvicorn's timeout): take the handler along, its
                task.cancel()  # cleanup (the engine abort) run to its end first
                await asyncio.shield(asyncio.gather(task, return_exceptions=True))
            self.drain._remove(task)


class _Reply:
    """The app's `send`, noting how far its response got, so an aborted one can be ended cleanly."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = self.finished = self.is_stream = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.is_stream = any(name == b"content-type" and value.startswith(b"text/event-stream")
                                 for name, value in message.get("headers", ()))
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    async def end(self, scope: Scope, receive: Receive) -> None:
        """The end of a response cut by the drain: the 503, or the rest of a begun one (an SSE error event)."""
        if not self.started:
            await _refuse(scope, receive, self._send)
        elif not self.finished:
            await self._send({"type": "http.response.body", "body": _STREAM_END if self.is_stream else b"",
                              "more_body": False})


async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
    await error_response(_REFUSAL, _CLOSE)(scope, receive, send)
