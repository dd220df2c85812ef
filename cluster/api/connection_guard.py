"""`guarded_protocol(limits)`: uvicorn's HTTP protocol (httptools, else h11) with the bounds a connection needs
before it is a request: uvicorn itself has no header timeout, and its `limit_concurrency` accepts every connection
and answers only once a request's headers have come (so 200 connections sending their headers slowly are all held).

    max_connections         a connection beyond it gets 503 at once and is closed, before anything is read
    header_timeout_seconds  from the connection's start, or from its last response, to the end of the next
                            request's headers: 408 and close past it (a slow-header client holds nothing longer)
    max_header_bytes        bytes received while the headers are incomplete: 431 and close beyond it

Each refusal is OpenAI's error JSON naming its limit, written straight to the transport (no request reached the
app). The idle time between requests stays uvicorn's `timeout_keep_alive`. Runs on the event loop, as uvicorn's
protocol does.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from k3serve.cluster.ingress_limits import IngressLimits

from .errors import error_body


def guarded_protocol(limits: IngressLimits) -> type[asyncio.Protocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)`."""

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_bytes = 0
            self._header_timer: asyncio.TimerHandle | None = None
            self._cycle_timed: Any = None  # the request cycle that was current when the timer was armed
            over = len(self.connections) >= limits.max_connections  # before this one joins them
            super().connection_made(transport)
            if over:
                self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, f"the server holds max_connections "
                             f"({limits.max_connections}) connections: retry later")
                return
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            waiting = self._header_timer is not None
            if waiting:
                self._header_bytes += len(data)
            super().data_received(data)
            if not waiting or self.transport.is_closing():
                return
            if self.cycle is not self._cycle_timed:  # the headers are complete: a new request cycle began
                self._disarm_header_timer()
            elif self._header_bytes > limits.max_header_bytes:
                self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"the request line and headers exceed "
                             f"max_header_bytes ({limits.max_header_bytes})")

        def on_response_complete(self) -> None:
            super().on_response_complete()
            idle = self.cycle is None or self.cycle.response_complete  # no pipelined request started meanwhile
            if idle and not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers, if the client sends one

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_bytes, self._cycle_timed = 0, self.cycle
            self._header_timer = self.loop.call_later(limits.header_timeout_seconds, self._header_timed_out)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if self.cycle is self._cycle_timed and not self.transport.is_closing():
                self._refuse(HTTPStatus.REQUEST_TIMEOUT, f"the request headers did not arrive within "
                             f"header_timeout_seconds ({limits.header_timeout_seconds:g})")

        def _refuse(self, status: HTTPStatus, message: str) -> None:
            self._disarm_header_timer()
            body = json.dumps(error_body(status, message)).encode()
            head = (f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
            self.transport.write(head + body)
            self.transport.close()

    return GuardedHTTPProtocol
