"""POST /v1/responses: OpenAI's Responses API, as vLLM serves it, over the chat route's machinery.

A request becomes one chat completion (`ResponseTurn.of`): `instructions` a system message, `input` the messages
(a string: one user turn; items: messages with text parts, `function_call` items as the assistant's tool calls,
`function_call_output` items as tool messages; `reasoning` items are dropped: the prompt renders no past
thinking), function `tools` and `tool_choice` in the chat's nested form, `max_output_tokens` as max_tokens,
`reasoning.effort` as reasoning_effort, `text.format` as response_format. The chat's answer becomes the output
items, in order: a `reasoning` item (reasoning_text), a `message` (output_text), a `function_call` per call.

Streaming (SSE, `event: <type>` then `data: <json>`, no [DONE]): response.created, response.in_progress, then per
item output_item.added, its deltas (reasoning_text.delta; content_part.added, output_text.delta; or
function_call_arguments.delta), their .done events and output_item.done, then response.completed with the whole
response; every event has its sequence_number. An error after the first event is an `error` event.

Nothing is stored: `previous_response_id` is a 400 (send the whole conversation as input), as are tool types
other than function. `usage.output_tokens_details.reasoning_tokens` counts the reasoning text re-encoded.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError

from k3serve.cluster.metrics import RequestTimer

from .engine_client import EngineClient
from .errors import bad_request, error_body
from .fanout import FanOut
from .protocol import ChatCompletionRequest, ChatCompletionResponse, UsageInfo, _Request
from .serving import STATUS_CLIENT_GONE, Prepared, to_api_error


class FunctionTool(BaseModel):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(BaseModel):
    effort: str | None = None
    summary: str | None = None


class TextConfig(BaseModel):
    format: dict[str, Any] | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    """Accepted as vLLM's default; nothing is stored (no GET /v1/responses/{id})."""
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


class ResponseTurn:
    """One request of the Responses API: its chat completion (`chat`) and the response made of its answer."""

    def __init__(self, body: ResponsesRequest, chat: ChatCompletionRequest, client: EngineClient) -> None:
        self.body, self.chat, self.tokenizer, self.model = body, chat, client.tokenizer, client.model_name
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    @classmethod
    def of(cls, body: ResponsesRequest, client: EngineClient) -> "ResponseTurn":
        """The turn, or a 400 naming what cannot be served (an APIError; RequestValidationError for a value the
        chat refuses, under the chat's field name)."""
        if body.previous_response_id is not None:
            raise bad_request("previous_response_id is not served: responses are not stored; send the whole "
                              "conversation as input", "previous_response_id")
        chat: dict[str, Any] = {"messages": _messages(body), "stream": body.stream,
                                "parallel_tool_calls": body.parallel_tool_calls}
        if body.stream:
            chat["stream_options"] = {"include_usage": True}
        for name in ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "seed"):
            if getattr(body, name) is not None:
                chat[name] = getattr(body, name)
        if body.max_output_tokens is not None:
            chat["max_tokens"] = body.max_output_tokens
        if body.tools:
            chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(body.tools)]
            chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
        if body.reasoning is not None and body.reasoning.effort is not None:
            chat["reasoning_effort"] = body.reasoning.effort
        if body.text is not None and body.text.format is not None:
            chat["response_format"] = _response_format(body.text.format)
        try:
            return cls(body, ChatCompletionRequest.model_validate(chat), client)
        except ValidationError as e:
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None

    # ---- the whole response ------------------------------------------------------------------------------------
    def response(self, chat: ChatCompletionResponse) -> dict[str, Any]:
        """The Response object of the chat's answer (`_serve`'s JSON)."""
        choice = chat.choices[0]
        message, items = choice.message, []
        if message.reasoning:
            items.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", message.reasoning, "completed"))
        if message.content:
            items.append(_message_item(f"msg_{uuid.uuid4().hex}", message.content, "completed"))
        for call in message.tool_calls or []:
            items.append(_call_item(f"fc_{uuid.uuid4().hex}", call.id, call.function.name, call.function.arguments,
                                    "completed"))
        return self._object(items, choice.finish_reason, chat.usage, message.reasoning or "")

    def _object(self, output: list[dict[str, Any]], finish_reason: str | None, usage: UsageInfo | None,
                reasoning: str) -> dict[str, Any]:
        b = self.body
        done = finish_reason is not None
        status = "in_progress" if not done else "incomplete" if finish_reason == "length" else "completed"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "instructions": b.instructions, "metadata": b.metadata, "user": b.user,
            "max_output_tokens": b.max_output_tokens, "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": None, "reasoning": b.reasoning.model_dump() if b.reasoning else None,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "text": {"format": b.text.format if b.text and b.text.format else {"type": "text"}},
            "tool_choice": b.tool_choice, "tools": [t.model_dump(exclude_none=True) for t in b.tools],
            "truncation": "disabled", "background": False, "service_tier": "auto", "store": False,
            "usage": None if usage is None else self._usage(usage, reasoning),
        }

    def _usage(self, usage: UsageInfo, reasoning: str) -> dict[str, Any]:
        return {"input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": len(self.tokenizer.encode(reasoning)) if reasoning else 0},
                "total_tokens": usage.total_tokens}

    # ---- streamed ---------------------------------------------------------------------------------------------
    async def events(self, prep: Prepared, fan: FanOut, timer: RequestTimer) -> AsyncIterator[str]:
        """The SSE events of a streamed response (the module docstring's order)."""
        stream = _EventStream(self)
        try:
            for event in stream.start():
                yield event
            async for index, delta in fan:
                for chunk in prep.choices[index].chunks(delta):
                    for event in stream.chunk(chunk):
                        yield event
            timer.finish(prep.choices.finish_reason)
            for event in stream.end(prep.choices.finish_reason, prep.choices.usage):
                yield event
        except Exception as e:
            err = to_api_error(e)
            timer.fail(err.status)
            body = error_body(err.status, err.message, err.param, err.type)["error"]
            yield stream.event("error", code=str(err.status), message=body["message"], param=body["param"])
        finally:
            timer.fail(STATUS_CLIENT_GONE)  # unless counted above: the client went away
            await fan.close()


class _EventStream:
    """The open output item of a streamed response and the events that open, extend and close it."""

    def __init__(self, turn: ResponseTurn) -> None:
        self.turn = turn
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # the items closed so far
        self.open: dict[str, Any] | None = None  # the item being streamed: its kind, id, text, ...
        self.reasoning = ""

    def event(self, type: str, **fields: Any) -> str:
        data = {"type": type, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        response = self.turn._object([], None, None, "")
        return [self.event("response.created", response=response), self.event("response.in_progress", response=response)]

    def chunk(self, chunk) -> list[str]:
        events: list[str] = []
        for choice in chunk.choices:
            d = choice.delta
            if d.reasoning:
                events += self._text("reasoning", d.reasoning)
            if d.content:
                events += self._text("message", d.content)
            for call in d.tool_calls or []:
                events += self._call(call)
        return events

    def end(self, finish_reason: str | None, usage: UsageInfo) -> list[str]:
        events = self._close()
        response = self.turn._object(self.output, finish_reason or "stop", usage, self.reasoning)
        return events + [self.event("response.completed", response=response)]

    def _text(self, kind: Literal["reasoning", "message"], text: str) -> list[str]:
        events = [] if self.open is not None and self.open["kind"] == kind else self._close() + self._open(kind)
        item = self.open
        item["text"] += text
        index = len(self.output)
        if kind == "reasoning":
            self.reasoning += text
            return events + [self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                        content_index=0, delta=text)]
        return events + [self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                    content_index=0, delta=text, logprobs=[])]

    def _call(self, call) -> list[str]:
        events = []
        if call.id is not None:  # a call's first piece: its id and name
            events += self._close()
            self.open = {"kind": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id,
                         "name": call.function.name or "", "text": ""}
            events.append(self.event("response.output_item.added", output_index=len(self.output),
                                     item=self._item("in_progress")))
        if call.function.arguments:
            self.open["text"] += call.function.arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=len(self.output), delta=call.function.arguments))
        return events

    def _open(self, kind: str) -> list[str]:
        self.open = {"kind": kind, "id": f"{'rs' if kind == 'reasoning' else 'msg'}_{uuid.uuid4().hex}", "text": ""}
        index = len(self.output)
        events = [self.event("response.output_item.added", output_index=index, item=self._item("in_progress"))]
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=index,
                                     content_index=0, part=_output_text("")))
        return events

    def _close(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        index, events = len(self.output), []
        if item["kind"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["text"]))
        elif item["kind"] == "message":
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=item["text"], logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=_output_text(item["text"]))]
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["text"]))
        done = self._item("completed")
        events.append(self.event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        self.open = None
        return events

    def _item(self, status: str) -> dict[str, Any]:
        item = self.open
        if item["kind"] == "reasoning":
            return _reasoning_item(item["id"], item["text"], status)
        if item["kind"] == "message":
            return _message_item(item["id"], item["text"], status)
        return _call_item(item["id"], item["call_id"], item["name"], item["text"], status)


# ---- items ---------------------------------------------------------------------------------------------------------
def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_output_text(text)] if status == "completed" else []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


# ---- request -> chat ----------------------------------------------------------------------------------------------
_TEXT_PARTS = ("input_text", "output_text", "text")


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"input[{i}]: a message's role is user, assistant, system or developer, got "
                                  f"{role!r}", "input")
            messages.append({"role": "system" if role == "developer" else role, "content": _text(item, i)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", i), "type": "function",
                    "function": {"name": _field(item, "name", i), "arguments": _field(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)  # the calls of one turn, together
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise bad_request(f"input[{i}]: a function_call_output's output must be a string", "input")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", i), "content": output})
        elif kind != "reasoning":
            raise bad_request(f"input[{i}]: item type {kind!r} is not served (message, function_call, "
                              "function_call_output, reasoning)", "input")
    if not messages:
        raise bad_request("input is empty", "input")
    return messages


def _text(item: dict[str, Any], i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}]: a message's content is a string or a list of text parts", "input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            shown = part.get("type") if isinstance(part, dict) else part
            raise bad_request(f"input[{i}]: content parts are input_text or output_text with a text, got {shown!r}",
                              "input")
        parts.append(part["text"])
    return "".join(parts)


def _field(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value and name != "arguments":
        raise bad_request(f"input[{i}]: a {item.get('type')} item needs a string {name}", "input")
    return value


def _chat_tool(i: int, tool: FunctionTool) -> dict[str, Any]:
    if tool.type != "function":
        raise bad_request(f"tools[{i}]: only function tools are served, got type {tool.type!r}", "tools")
    if not tool.name:
        raise bad_request(f"tools[{i}]: a function tool needs a name", "tools")
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
                "strict": tool.strict}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice is "auto", "none", "required" or {"type": "function", "name": ...}',
                      "tool_choice")


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format.type is text, json_object or json_schema, got {kind!r}", "text")

