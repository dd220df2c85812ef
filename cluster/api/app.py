"""`build_app(client)`: the OpenAI-compatible routes over any `EngineClient`.

    POST /v1/completions, /v1/chat/completions   JSON, or SSE when stream=true
    POST /v1/responses                            OpenAI's Responses API over the chat route (responses.py)
    GET  /v1/models                               the one served model
    GET  /health, GET|POST /ping                  200, or 503 when client.check_health raises or the server drains
    GET  /version                                 {"version": k3serve's}
    POST /tokenize, /detokenize                   vLLM's shapes (tokenization.py)
    GET  /metrics                                 Prometheus text (IngressMetrics)

With an `api_key`, every /v1 route answers 401 unless the request carries `Authorization: Bearer
<key>` (auth.py: before any route runs); /health and /metrics stay open, for probes and Prometheus.

`app.state.drain` (drain.py) is the graceful stop `k3serve serve` runs on SIGTERM: once it drains, new requests
get 503 and /health 503, while those in flight run on (or are aborted with a clear end past the drain timeout).

Every error is OpenAI's error JSON with its status: 400 bad parameters (pydantic validation
included, never 422; text that is not valid Unicode; a bound of `IngressLimits` exceeded, named), 413 a body
over `max_request_body_bytes` (body_limit.py), 404 another model id, 503 overloaded or dead backend, 500
anything else (generic message; the traceback goes to the log only).

No request's size stalls the event loop the others share (docs/design/ingress_limits.md): its cheap checks run
first (request_limits.py: stop lists, logit_bias, a prompt too long in characters for the context), then its chat
template and tokenization, on a worker thread when its body is large (prepare_lane.py).

A request asks for one choice or several (`n`, a batch of prompts on /v1/completions): each is an
engine request of its own (serving.py, fanout.py), and they succeed, fail and are aborted together.
A client that disconnects has every choice aborted on the backend: while waiting for the first
deltas or aggregating, a watcher on the ASGI receive channel cancels the work; while streaming,
Starlette cancels the stream (serving.stream_sse then aborts), and a stream that never began
is closed when its response ends (`_SSEResponse`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3serve import __version__
from k3serve.cluster.errors import EngineOverloadedError
from k3serve.cluster.ingress_limits import IngressLimits
from k3serve.cluster.metrics import IngressMetrics, RequestTimer
from k3serve.engine.constraint import ConstraintCompileError

from .auth import BearerKeyAuth
from .body_limit import BODY_BYTES, BodyLimit
from .drain import Drain, DrainGate, count_cut_with
from .engine_client import EngineClient
from .errors import APIError, error_response
from .fanout import FanOut
from .parsers import chat_parsers
from .prepare_lane import PrepareLane
from .protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, _SamplingFields
from .request_limits import RequestLimits
from .responses import ResponsesRequest, ResponseTurn
from .serving import (
    STATUS_CLIENT_GONE,
    Prepared,
    aggregate,
    prepare_chat,
    prepare_completion,
    start,
    stream_sse,
    to_api_error,
)
from .structured_outputs import constraint_kind
from .tokenization import tokenization_routes

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


def build_app(client: EngineClient, metrics: IngressMetrics | None = None, reasoning_parser: str = "auto",
              api_key: str | None = None, tool_call_parser: str = "auto", enable_auto_tool_choice: bool = True,
              limits: IngressLimits | None = None) -> FastAPI:
    """`reasoning_parser` / `tool_call_parser`: the chat output parsers by vLLM's names ("auto": the checkpoint's
    format; parsers.py), `enable_auto_tool_choice` as vLLM's flag. `api_key`: the bearer key every /v1 route
    requires (None: all open); a refusal counts as a 401 error. `limits`: what one request may send (the defaults
    of IngressLimits when None); the connection limits among them are the server's to apply (connection_guard.py).
    ValueError for an unknown parser name."""
    parsers = chat_parsers(client.tokenizer.chat_format, reasoning_parser, tool_call_parser, enable_auto_tool_choice)
    if api_key == "":
        raise ValueError("api_key is empty: every request would pass with 'Bearer ' (None serves without a key)")
    metrics = metrics if metrics is not None else IngressMetrics(model_name=client.model_name,
                                                                 max_model_len=client.max_model_len)
    app = FastAPI(title="k3serve", summary="OpenAI-compatible ingress of k3serve")
    limits = limits if limits is not None else IngressLimits()
    app.state.client, app.state.metrics = client, metrics
    _install_error_handlers(app, metrics)
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_body_bytes, on_refused=metrics.count_error)
    if api_key is not None:
        app.add_middleware(BearerKeyAuth, api_key=api_key, on_refused=metrics.count_error)
    app.state.drain = drain = Drain()
    guard = _Guard(RequestLimits(limits, client.tokenizer, client.max_model_len), PrepareLane())
    app.add_middleware(DrainGate, drain=drain, on_refused=metrics.count_error)  # outermost: refuses before auth

    @app.get("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health() -> Response:
        if drain.draining:  # a load balancer stops routing here while the requests in flight finish
            return error_response(APIError(503, "draining: the server is shutting down"))
        try:
            await client.check_health()
        except Exception as e:
            logger.warning("health check failed: %r", e)
            shown = str(e) if isinstance(e, EngineOverloadedError) else type(e).__name__  # as to_api_error shows it
            return error_response(APIError(503, f"unhealthy: {shown}"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    app.include_router(tokenization_routes(client))

    @app.get("/v1/models")
    async def models() -> ModelList:
        name = client.model_name
        return ModelList(data=[ModelCard(id=name, root=name, max_model_len=client.max_model_len)])

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        try:
            await metrics.refresh()
        except Exception as e:  # the rest still renders; the stale gauges stay as last read
            logger.warning("metrics refresh failed: %r", e)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _serve(raw, client, metrics, guard, lambda: prepare_completion(body, client), body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _serve(raw, client, metrics, guard, lambda: prepare_chat(body, client, parsers), body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        turn = ResponseTurn.of(body, client)  # a request it cannot serve: 400 here
        return await _serve(raw, client, metrics, guard, lambda: prepare_chat(turn.chat, client, parsers), turn.chat,
                            respond=turn.response, stream=turn.events)

    return app


@dataclass(frozen=True)
class _Guard:
    """What keeps one request's size off the event loop: its cheap checks, then where its prepare runs."""

    limits: RequestLimits
    lane: PrepareLane


async def _serve(raw: Request, client: EngineClient, metrics: IngressMetrics, guard: _Guard,
                 prepare: Callable[[], Prepared], body: _SamplingFields,
                 respond: Callable[[Any], dict] | None = None, stream=stream_sse) -> Response:
    """`prepare`'s request run to its response: the aggregate as JSON (`respond`'s dict of it, else its model's),
    or `stream`'s SSE lines. `guard` bounds its size first."""
    timer = metrics.start_request()
    count_cut_with(raw.scope, timer.fail)  # a drain cut counts once, as its 503, stream or not
    kind = None  # of the request's structured output constraint, once its shape passed
    try:
        guard.limits.check(body)  # before the prompt is rendered or tokenized
        prep = await guard.lane.run(prepare, raw.scope[BODY_BYTES])
        kind = constraint_kind(body)
        if kind is not None:
            metrics.count_structured_output(kind)
        fan = await _unless_disconnected(raw, start(client, prep, timer))
        if prep.stream:
            return _SSEResponse(stream(prep, fan, timer), fan, timer)
        result = await _unless_disconnected(raw, aggregate(prep, fan, timer))
        return JSONResponse(result.model_dump(mode="json") if respond is None else respond(result))
    except ClientGone:
        timer.fail(STATUS_CLIENT_GONE)
        return Response(status_code=STATUS_CLIENT_GONE)
    except Exception as e:
        err = to_api_error(e)
        timer.fail(err.status)
        if kind is not None and isinstance(e, ConstraintCompileError):  # so is a Ray actor's error with that cause
            metrics.count_structured_output_refusal(kind)
        return error_response(err)


class _SSEResponse(StreamingResponse):
    """The SSE stream of a started request. Starlette may end the response without ever iterating its body (the
    client gone before the first send), and then `stream_sse` never runs its cleanup: the response's own end
    aborts whatever still runs (`close` is idempotent, a second `fail` counts nothing)."""

    def __init__(self, body: AsyncIterator[str], fan: FanOut, timer: RequestTimer) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self.fan, self.timer = fan, timer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.timer.fail(STATUS_CLIENT_GONE)
            await self.fan.close()


async def _unless_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelled (ClientGone) if the client disconnects first. The request body has
    been read already, so the next ASGI message can only be http.disconnect. Whenever the work is cut (the
    client gone, or this request itself cancelled by a drain's timeout), its cleanup, the engine abort, runs
    to its end before this returns or the cancellation goes on."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    cut = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            cut = True
            task.cancel()
            await asyncio.shield(asyncio.gather(task, return_exceptions=True))
    if cut:
        raise ClientGone()
    return task.result()


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _install_error_handlers(app: FastAPI, metrics: IngressMetrics) -> None:
    def respond(err: APIError) -> JSONResponse:
        metrics.count_error(err.status)
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc.errors())
        return respond(APIError(HTTPStatus.BAD_REQUEST, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return respond(to_api_error(exc))  # logs it; the client sees a generic 500


def _describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic errors as one message, and the first offending field as `param`."""
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
        if param is None and loc:
            param = loc[0]
    return "; ".join(parts) or "invalid request", param
