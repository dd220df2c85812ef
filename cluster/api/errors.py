"""Errors the ingress turns into OpenAI error JSON: `{"error": {"message", "type", "param", "code"}}`.

`code` carries the HTTP status (vLLM's convention); `type` uses OpenAI's vocabulary.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Mapping

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error with its HTTP status, raised anywhere in request handling."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or error_type(status)


def error_type(status: int) -> str:
    if status == HTTPStatus.SERVICE_UNAVAILABLE:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    if status == HTTPStatus.NOT_FOUND:
        return "not_found_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, type: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or error_type(status), "param": param, "code": status}}


def error_response(err: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The error's JSON reply, also an ASGI app: the middlewares (auth.py, drain.py) answer with it directly.
    `headers`: what the status asks for beside the body (a 401's WWW-Authenticate, a closing 503's Connection)."""
    return JSONResponse(error_body(err.status, err.message, err.param, err.type), status_code=err.status,
                        headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param)
