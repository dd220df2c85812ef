"""`BearerKeyAuth`: the ingress's API key, as vLLM's `--api-key`.

Every path under /v1 needs `Authorization: Bearer <key>`; anything else (/health for probes, /metrics
for Prometheus) stays open. A pure ASGI middleware, so a refused request never reaches a route: its
body is not even parsed, and the engine never sees it. (Starlette's BaseHTTPMiddleware would wrap the
receive channel that the routes watch for a client's disconnect.) The key is compared in constant
time and appears in no answer and no log line.
"""

from __future__ import annotations

import hmac
from http import HTTPStatus
from typing import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, error_response

GUARDED_PREFIX = "/v1"
UNAUTHORIZED = HTTPStatus.UNAUTHORIZED

# OpenAI's own 401 is an invalid_request_error with code "invalid_api_key"; here `code` is the HTTP
# status (errors.py), so the type says what failed. The OpenAI SDK raises AuthenticationError on the status.
_REFUSAL = APIError(UNAUTHORIZED, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    type="authentication_error")
_CHALLENGE = {"WWW-Authenticate": "Bearer"}  # RFC 9110: a 401 names the scheme it wants


def is_guarded(path: str) -> bool:
    return path == GUARDED_PREFIX or path.startswith(GUARDED_PREFIX + "/")


class BearerKeyAuth:
    """Answers 401 to an HTTP request under /v1 without the right bearer key; `on_refused` counts it."""

    def __init__(self, app: ASGIApp, api_key: str, on_refused: Callable[[int], None]) -> None:
        self.app = app
        self._key = api_key.encode()
        self._on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_guarded(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        self._on_refused(UNAUTHORIZED)
        await error_response(_REFUSAL, _CHALLENGE)(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(headers) != 1:
            return False
        scheme, _, token = headers[0].partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, self._key)
