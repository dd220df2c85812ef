"""One request's life at the ingress: prepare -> first deltas -> stream or aggregate -> clean up.

    prepare_*   body -> Prepared: an engine request and a formatter per choice (the `n` samples of
                each prompt of a batch), token ids (chat template applied), SamplingParams, checks
                (model id, context length, number of choices); raises APIError.
    start       opens the engine requests (`FanOut`) and waits for the first delta of each, so that
                every error the backend raises before generating (ValueError, overload, dead
                engine) still gets its own status instead of a 200 stream.
    stream_sse / aggregate
                the rest of the deltas, as SSE lines (choices interleaved as they come) or as one
                response (choices in index order).

Whatever ends a request early (client gone, cancellation, an error of any choice) aborts every
choice on the backend: `FanOut.close`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import AsyncIterator, Callable

from k3serve.engine.outputs import RequestDelta
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import EngineDeadError, GenerateRequest

from k3serve.cluster.metrics import RequestTimer

from .engine_client import EngineClient
from k3serve.cluster.errors import EngineOverloadedError

from .errors import APIError, bad_request, error_body
from .fanout import FanOut
from .forced_tool_choice import forced_call_stream
from .formatting import ChatFormatter, Choices, CompletionFormatter, Formatter
from .protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, _SamplingFields
from .parsers import ChatParsers, chat_parsers
from .structured_outputs import structured_outputs_of
from .template_kwargs import template_kwargs

logger = logging.getLogger(__name__)

STATUS_CLIENT_GONE = 499  # nginx's "client closed request": counted, never sent


@dataclass
class Prepared:
    requests: list[GenerateRequest]  # an engine request per choice, in choice index order
    choices: Choices  # a formatter per choice, in the same order
    stream: bool
    include_usage: bool
    is_chat: bool


# ---- prepare ----------------------------------------------------------------------------------
def prepare_completion(body: CompletionRequest, client: EngineClient) -> Prepared:
    _check_model(body.model, client)
    prompt_logprobs = body.logprobs if body.echo else None
    prompts = []
    for prompt_ids in _completion_prompts(body.prompt, body.n, client):
        max_tokens = _fit_context(len(prompt_ids), body.max_tokens, client.max_model_len, "prompt")
        prompts.append((prompt_ids, _sampling_params(body, max_tokens, body.logprobs, client, prompt_logprobs)))
    request_id = f"cmpl-{uuid.uuid4().hex}"

    def formatter(index: int, prompt_ids: list[int]) -> Formatter:  # each choice echoes its own prompt
        return CompletionFormatter(request_id, client.model_name, client.tokenizer, _continuous(body), index=index,
                                   echo_prompt=prompt_ids if body.echo else None)

    return _prepared(request_id, prompts, body, formatter, is_chat=False)


def prepare_chat(body: ChatCompletionRequest, client: EngineClient, parsers: ChatParsers | None = None) -> Prepared:
    """`parsers` (parsers.py; default: the checkpoint's format, auto-resolved) read the output: a thinking model's
    reasoning goes to `reasoning`, its calls to `tool_calls`. A structured output constraint covers the whole
    output, so a constrained request is never split: its content is the constrained text (structured_outputs.py);
    on K3 its prompt opens the response channel (no thinking). A forced tool choice is such a constraint: its output
    is all JSON, read back as tool calls (forced_tool_choice.py) rather than through the model's tool-call parser.
    The prompt takes `chat_template_kwargs` and `reasoning_effort` as the format reads them (template_kwargs)."""
    _check_model(body.model, client)
    tokenizer = client.tokenizer
    parsers = parsers or chat_parsers(tokenizer.chat_format)
    constrained = body.forces_tool_calls or structured_outputs_of(body) is not None
    kwargs = template_kwargs(body, tokenizer, constrained)
    tools = body.active_tools
    if tokenizer.chat_format == "kimi_k3" and body.tools:  # K3 sees its tools with tool_choice "none" too
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if body.active_tools is not None and not body.forces_tool_calls and not parsers.auto_tool_choice:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice (enable_auto_tool_choice)',
                          "tool_choice")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        prompt_ids = tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt, tools=tools,
                                           **kwargs)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    max_tokens = _fit_context(len(prompt_ids), body.effective_max_tokens, client.max_model_len, "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling_params(body, max_tokens, logprobs, client)
    reasoning = parsers.reasoning != "none" and params.structured_outputs is None
    calls_allowed = body.active_tools is not None and not body.forces_tool_calls
    # K3's tool-call parser also unwraps the response channel, with no tools too (not a constrained output's text)
    read_calls = calls_allowed or (parsers.xtml and params.structured_outputs is None)
    specials = tokenizer.special_tokens
    if read_calls or reasoning:  # the parsers read their markers in the text (as vLLM's parsers ask)
        markers = parsers.markers(reasoning, read_calls)
        # Only the markers: every other special token is still skipped token by token, so the text is what it
        # would be without the parsers (dropping them from the text instead differs where one splits a character).
        params = dataclasses.replace(params, keep_special_token_ids=sorted({specials[m] for m in markers
                                                                             if m in specials}))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    thinking = kwargs.get("thinking", True)

    def formatter(index: int, prompt_ids: list[int]) -> Formatter:
        split = None if not reasoning else parsers.reasoning_stream(
            specials, prompt_ids, thinking=thinking, keep_special=read_calls or not body.skip_special_tokens)
        calls = parsers.tool_call_stream(body.max_tool_calls, calls_allowed) if read_calls else None
        return ChatFormatter(request_id, client.model_name, tokenizer, _continuous(body), index=index,
                             top_logprobs=body.top_logprobs or 0, reasoning=split, tool_calls=calls,
                             forced_calls=forced_call_stream(body))

    return _prepared(request_id, [(prompt_ids, params)], body, formatter, is_chat=True)


def _prepared(request_id: str, prompts: list[tuple[list[int], SamplingParams]], body: _SamplingFields,
              formatter: Callable[[int, list[int]], Formatter], is_chat: bool) -> Prepared:
    """An engine request and a formatter per choice: `n` of each prompt, choice `prompt * n + j` the j-th sample of
    `prompt` (vLLM's order). A request of one choice keeps the response's id on the engine; several are told apart
    by their index."""
    n, requests, formatters = body.n, [], []
    for prompt_ids, params in prompts:
        for sample in range(n):
            index = len(requests)
            engine_id = request_id if len(prompts) * n == 1 else f"{request_id}-{index}"
            requests.append(GenerateRequest(engine_id, prompt_ids, _sample_params(params, sample)))
            formatters.append(formatter(index, prompt_ids))
            formatters[-1].num_prompt_tokens = len(prompt_ids)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return Prepared(requests, Choices(formatters, n), body.stream, include_usage, is_chat)


def _sample_params(params: SamplingParams, sample: int) -> SamplingParams:
    """The j-th sample's own copy of the prompt's params. With a seed, seed + j (vLLM's `ParentRequest` rule): the
    samples differ from each other, and the same seed reproduces every one of them (sample 0 is what n = 1 gives)."""
    return dataclasses.replace(params, seed=None if params.seed is None else params.seed + sample)


def _continuous(body: _SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.continuous_usage_stats


def _check_model(model: str | None, client: EngineClient) -> None:
    if model is not None and model != client.model_name:
        raise APIError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", "model")


def _completion_prompts(prompt: str | list, n: int, client: EngineClient) -> list[list[int]]:
    """The prompt, or each prompt of a batch, as token ids."""
    batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    if len(batch) * n > MAX_CHOICES:
        raise bad_request(f"a request has at most {MAX_CHOICES} choices (n times the number of prompts), got "
                          f"{len(batch)} prompts with n={n}: split the batch", "prompt")
    prompts = []
    for i, one in enumerate(batch):
        ids = client.tokenizer.encode(one) if isinstance(one, str) else list(one)
        if not ids:
            raise bad_request("the prompt is empty" if len(batch) == 1 else f"prompt {i} of the batch is empty",
                              "prompt")
        prompts.append(ids)
    return prompts


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
            logit_bias=_logit_bias(body.logit_bias), structured_outputs=structured_outputs_of(body),
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


# ---- run ----------------------------------------------------------------------------------------
async def start(client: EngineClient, prep: Prepared, timer: RequestTimer) -> FanOut:
    """Open every choice's engine request and wait for each one's first delta (errors before them propagate)."""

    def observe(index: int, delta: RequestDelta) -> None:  # as soon as it arrives: TTFT / ITL
        timer.on_delta(len(delta.new_token_ids), delta.num_prompt_tokens, delta.num_output_tokens, choice=index,
                       prompt=prep.choices.prompt_of(index), num_cached_tokens=delta.num_cached_tokens)

    fan = FanOut(client, prep.requests, observe)
    await fan.start()
    return fan


async def stream_sse(prep: Prepared, fan: FanOut, timer: RequestTimer) -> AsyncIterator[str]:
    """SSE lines: [a role chunk per choice,] content chunks of the choices as they come, each ending with its
    finish reason, [usage chunk,] [DONE]. An error after the first chunk is sent as an error event (the status is
    already 200)."""
    choices = prep.choices
    try:
        if prep.is_chat:
            for fmt in choices:
                yield _sse(fmt.role_chunk())
        async for index, delta in fan:
            for chunk in choices[index].chunks(delta):
                yield _sse(chunk)
        timer.finish(choices.finish_reason)
        if prep.include_usage:
            yield _sse(choices.usage_chunk())
        yield "data: [DONE]\n\n"
    except Exception as e:
        err = to_api_error(e)
        timer.fail(err.status)
        yield f"data: {_json(error_body(err.status, err.message, err.param, err.type))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        timer.fail(STATUS_CLIENT_GONE)  # unless counted above: the client went away (cancelled, generator closed)
        await fan.close()


async def aggregate(prep: Prepared, fan: FanOut, timer: RequestTimer):
    """All deltas folded into one response model."""
    try:
        async for index, delta in fan:
            prep.choices[index].add(delta)
    finally:
        await fan.close()
    timer.finish(prep.choices.finish_reason)
    return prep.choices.response()


def _json(data: dict) -> str:
    return json.dumps(data, separators=(",", ":"))


def _sse(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"
