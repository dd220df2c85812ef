"""`BodyLimit`: the ASGI middleware that answers 413 to a request body over `max_request_body_bytes`.

A body that announces more (Content-Length) is refused before a byte of it is read; one sent in chunks is read
up to the limit and refused at the first chunk beyond it. A body within the limit is read whole here, then handed
to the app as it came (its messages replayed, then the client's channel as it is: the routes still see the
client's disconnect), its size in the scope (`BODY_BYTES`). Pure ASGI, as auth.py and drain.py: the refusal is
OpenAI's error JSON, naming the limit, with `Connection: close` (the rest of the body is not read, so the
connection cannot carry another request).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, error_response

_CLOSE = {"Connection": "close"}
BODY_BYTES = "k3serve.body_bytes"  # scope key: the size of the body read, for the routes (app.py)


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[int], None] | None = None) -> None:
        """`on_refused(413)` counts each refusal (IngressMetrics.count_error)."""
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = _content_length(scope)
        if announced is not None and announced > self.max_bytes:
            await self._refuse(scope, receive, send, f"announces {announced} bytes")
            return
        messages: list[Message] = []
        size, more = 0, True
        while more:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client left: the app sees it as it would have
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"has more than {self.max_bytes} bytes")
                return
            more = message.get("more_body", False)

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        scope[BODY_BYTES] = size
        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        if self.on_refused is not None:
            self.on_refused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        err = APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the request body {what}, more than "
                       f"max_request_body_bytes ({self.max_bytes}) allows")
        await error_response(err, _CLOSE)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length itself
    return None
