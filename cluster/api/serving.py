"""One request's life at the ingress: prepare -> first delta -> stream or aggregate -> clean up.

    prepare_*   body -> Prepared: token ids (chat template applied), SamplingParams, checks
                (model id, context length, batch of one); raises APIError.
    start       opens the backend stream and waits for its first delta, so that every error
                the backend raises before generating (ValueError, overload, dead engine) still
                gets its own status instead of a 200 stream.
    stream_sse / aggregate
                the rest of the deltas, as SSE lines or as one response.

Whatever ends a request early (client gone, cancellation, error) aborts it on the backend:
`_close` calls `client.abort` and closes the iterator, shielded from the cancellation that is
usually the reason it runs.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import AsyncIterator, Union

import anyio

from k3serve.engine.async_engine import EngineDeadError, GenerateRequest
from k3serve.engine.outputs import RequestDelta
from k3serve.engine.sampling_params import SamplingParams

from k3serve.cluster.metrics import RequestTimer

from .engine_client import EngineClient
from .errors import APIError, EngineOverloadedError, bad_request, error_body
from .formatting import ChatFormatter, CompletionFormatter
from .protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields

logger = logging.getLogger(__name__)

STATUS_CLIENT_GONE = 499  # nginx's "client closed request": counted, never sent

Formatter = Union[CompletionFormatter, ChatFormatter]


@dataclass
class Prepared:
    request_id: str
    prompt_token_ids: list[int]  # [num_prompt_tokens]
    params: SamplingParams
    stream: bool
    include_usage: bool
    formatter: Formatter
    is_chat: bool

    @property
    def generate_request(self) -> GenerateRequest:
        return GenerateRequest(self.request_id, self.prompt_token_ids, self.params)


# ---- prepare ----------------------------------------------------------------------------------
def prepare_completion(body: CompletionRequest, client: EngineClient) -> Prepared:
    _check_model(body.model, client)
    prompt_ids = _completion_prompt(body.prompt, client)
    max_tokens = _fit_context(len(prompt_ids), body.max_tokens, client.max_model_len, "prompt")
    prompt_logprobs = body.logprobs if body.echo else None
    params = _sampling_params(body, max_tokens, body.logprobs, client, prompt_logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    formatter = CompletionFormatter(request_id, client.model_name, client.tokenizer, _continuous(body),
                                    echo_prompt=prompt_ids if body.echo else None)
    return _prepared(request_id, prompt_ids, params, body, formatter, is_chat=False)


def prepare_chat(body: ChatCompletionRequest, client: EngineClient) -> Prepared:
    _check_model(body.model, client)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        prompt_ids = client.tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    max_tokens = _fit_context(len(prompt_ids), body.effective_max_tokens, client.max_model_len, "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling_params(body, max_tokens, logprobs, client)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    formatter = ChatFormatter(request_id, client.model_name, client.tokenizer, _continuous(body),
                              top_logprobs=body.top_logprobs or 0)
    return _prepared(request_id, prompt_ids, params, body, formatter, is_chat=True)


def _prepared(request_id: str, prompt_ids: list[int], params: SamplingParams, body: _SamplingFields,
              formatter: Formatter, is_chat: bool) -> Prepared:
    formatter.num_prompt_tokens = len(prompt_ids)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return Prepared(request_id, prompt_ids, params, body.stream, include_usage, formatter, is_chat)


def _continuous(body: _SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.continuous_usage_stats


def _check_model(model: str | None, client: EngineClient) -> None:
    if model is not None and model != client.model_name:
        raise APIError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", "model")


def _completion_prompt(prompt: str | list, client: EngineClient) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # a batch
        if len(prompt) != 1:
            raise bad_request(f"batched prompts are not supported: send one prompt per request (got {len(prompt)})",
                              "prompt")
        prompt = prompt[0]
    ids = client.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    return ids


def _fit_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, what: str) -> int:
    """max_tokens, or all the room the context leaves; 400 with OpenAI's message if it does not fit."""
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{num_prompt_tokens} input tokens. Please reduce the length of the {what}.", what)
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        param = what if num_prompt_tokens >= max_model_len else "max_tokens"
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {what}, {max_tokens} in the "
            f"completion). Please reduce the length of the {what} or completion.", param)
    return max_tokens


_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0}
_PARAM_OF_MESSAGE = re.compile(r"^(\w+) must")
_TOKEN_ID = re.compile(r"[0-9]+")


def _sampling_params(body: _SamplingFields, max_tokens: int, logprobs: int | None,
                     client: EngineClient, prompt_logprobs: int | None = None) -> SamplingParams:
    kwargs = {name: default if getattr(body, name) is None else getattr(body, name)
              for name, default in _NEUTRAL.items()}
    stop_token_ids = list(body.stop_token_ids or [])
    if not body.ignore_eos:  # as vLLM: the tokenizer's other end tokens (<|im_end|>) stop too
        eos = client.tokenizer.eos_token_id
        stop_token_ids += sorted(t for t in client.tokenizer.stop_token_ids if t != eos and t not in stop_token_ids)
    try:
        return SamplingParams(
            **kwargs, seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop,
            stop_token_ids=stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens, include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=_logit_bias(body.logit_bias),
        )
    except ValueError as e:
        raise _bad_value(e) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's map with token ids as JSON (string) keys -> SamplingParams' map with int keys."""
    if bias is None:
        return None
    for key in bias:
        if not _TOKEN_ID.fullmatch(key):
            raise bad_request(f"logit_bias must have token ids (decimal integers >= 0) as keys, got {key!r}",
                              "logit_bias")
    return {int(key): value for key, value in bias.items()}


def _bad_value(e: ValueError) -> APIError:
    """A 400 naming the parameter when the message starts with it ("top_p must ...", as SamplingParams and the
    engine word theirs)."""
    match = _PARAM_OF_MESSAGE.match(str(e))
    return bad_request(str(e), match.group(1) if match else None)


# ---- errors -----------------------------------------------------------------------------------
def to_api_error(e: BaseException) -> APIError:
    """Any failure as the APIError it is answered with; unexpected ones are logged, not shown."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return _bad_value(_remote_cause(e))
    if isinstance(e, EngineOverloadedError):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(e) or "The server is overloaded; retry later.")
    if isinstance(e, EngineDeadError):
        logger.error("engine dead: %r", e)
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, "The engine is not available.")
    logger.exception("unexpected error while serving a request", exc_info=e)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, "Internal server error.")


def _remote_cause(e: ValueError) -> ValueError:
    """What the worker raised, for an error that crossed a Ray actor call: Ray's RayTaskError is an instance of the
    cause's type and keeps the cause as `cause`, but its message is the remote traceback, not the client's."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, ValueError) else e


# ---- run --------------------------------------------------------------------------------------
async def start(client: EngineClient, prep: Prepared,
                timer: RequestTimer) -> tuple[RequestDelta, AsyncIterator[RequestDelta]]:
    """Open the backend stream and wait for its first delta (errors before it propagate)."""
    stream = client.generate(prep.generate_request)
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        await _close(client, prep.request_id, stream)
        raise RuntimeError(f"{prep.request_id}: the backend ended the stream without a delta") from None
    except BaseException:
        await _close(client, prep.request_id, stream)
        raise
    _observe(timer, first)
    return first, stream


async def stream_sse(client: EngineClient, prep: Prepared, first: RequestDelta,
                     stream: AsyncIterator[RequestDelta], timer: RequestTimer) -> AsyncIterator[str]:
    """SSE lines: [role chunk,] content chunks, [usage chunk,] [DONE]. An error after the first
    chunk is sent as an error event (the status is already 200)."""
    fmt, finished, failed = prep.formatter, False, False
    try:
        if prep.is_chat:
            yield _sse(fmt.role_chunk())
        delta = first
        while True:
            for chunk in fmt.chunks(delta):
                yield _sse(chunk)
            if delta.finished:
                finished = True
                break
            delta = _observe(timer, await _next(stream, prep.request_id))
        if prep.include_usage:
            yield _sse(fmt.usage_chunk())
        timer.finish(fmt.finish_reason)
        yield "data: [DONE]\n\n"
    except Exception as e:
        failed, err = True, to_api_error(e)
        timer.fail(err.status)
        yield f"data: {_json(error_body(err.status, err.message, err.param, err.type))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not (finished or failed):  # the client went away (cancelled, or the generator was closed)
            timer.fail(STATUS_CLIENT_GONE)
        await _close(client, prep.request_id, stream, abort=not finished)


async def aggregate(client: EngineClient, prep: Prepared, first: RequestDelta,
                    stream: AsyncIterator[RequestDelta], timer: RequestTimer):
    """All deltas folded into one response model."""
    fmt, finished = prep.formatter, False
    try:
        delta = first
        while True:
            fmt.add(delta)
            if delta.finished:
                finished = True
                break
            delta = _observe(timer, await _next(stream, prep.request_id))
    finally:
        await _close(client, prep.request_id, stream, abort=not finished)
    timer.finish(fmt.finish_reason)
    return fmt.response()


def _observe(timer: RequestTimer, delta: RequestDelta) -> RequestDelta:
    """Time a delta as soon as it arrives (TTFT / ITL), before any formatting."""
    timer.on_delta(len(delta.new_token_ids), delta.num_prompt_tokens, delta.num_output_tokens)
    return delta


async def _next(stream: AsyncIterator[RequestDelta], request_id: str) -> RequestDelta:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise RuntimeError(f"{request_id}: the backend ended the stream before a finished delta") from None


async def _close(client: EngineClient, request_id: str, stream: AsyncIterator[RequestDelta],
                 abort: bool = True) -> None:
    with anyio.CancelScope(shield=True):
        try:
            if abort:
                await client.abort(request_id)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        except Exception:
            logger.exception("%s: cleanup failed", request_id)


def _json(data: dict) -> str:
    import json

    return json.dumps(data, separators=(",", ":"))


def _sse(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"
