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
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body

SHUTTING_DOWN = HTTPStatus.SERVICE_UNAVAILABLE
_ALWAYS_OPEN = ("/health", "/metrics")  # the probe answers 503 itself; Prometheus reads the last counts
_BODY = json.dumps(error_body(SHUTTING_DOWN, "server is shutting down: retry on another replica")).encode()
_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode()),
            (b"connection", b"close")]
_STREAM_END = f"data: {_BODY.decode()}\n\ndata: [DONE]\n\n".encode()


class Drain:
    """Whether the ingress drains, and the handlers of the requests in flight."""

    def __init__(self) -> None:
        self.draining = False
        self._running: set[asyncio.Task] = set()
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
        """Cancel every request in flight and wait (up to `timeout_s`) until each one's client has had its end."""
        for task in list(self._running):
            task.cancel()
        try:
            await asyncio.wait_for(self.wait_idle(), timeout_s)
        except asyncio.TimeoutError:
            pass  # uvicorn's own graceful-shutdown timeout cancels what is left

    def _add(self, task: asyncio.Task) -> None:
        self._running.add(task)
        self._idle.clear()

    def _remove(self, task: asyncio.Task) -> None:
        self._running.discard(task)
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
            await _refuse(send)
            return
        reply = _Reply(send)
        task = asyncio.ensure_future(self.app(scope, receive, reply))
        self.drain._add(task)
        try:
            await asyncio.wait({task})  # not `await task`: a cancelled handler must not cancel the gate
            if task.cancelled():  # by drain.abort(): tell the client
                await reply.end()
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

    async def end(self) -> None:
        """The end of a response cut by the drain: the 503, or the rest of a begun one (an SSE error event)."""
        if not self.started:
            await _refuse(self._send)
        elif not self.finished:
            await self._send({"type": "http.response.body", "body": _STREAM_END if self.is_stream else b"",
                              "more_body": False})


async def _refuse(send: Send) -> None:
    await send({"type": "http.response.start", "status": SHUTTING_DOWN, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": _BODY})
