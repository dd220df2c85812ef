"""A forced tool choice on /v1/chat/completions, as vLLM's OpenAI server serves it: the constraint it puts on the
output, and that output read back as tool calls.

    tool_choice {"type": "function", "function": {"name": N}}
        the output is N's arguments: JSON of N's `parameters` schema; it comes back as one call of N whose
        arguments are the output as written. finish_reason stays the engine's ("stop"), as OpenAI and vLLM
        answer a named choice.
    tool_choice "required"
        the output is a JSON array of at least one {"name": <a tool's name>, "parameters": <its arguments>},
        anyOf over the tools (vLLM's schema; the tools' `$defs` hoisted to its root, where their `$ref`s point);
        each element comes back as a call, its arguments the element's `parameters` as JSON text.
        finish_reason "tool_calls" once it stopped. With parallel_tool_calls false the array has at most one
        element (`maxItems` 1, as vLLM's schema).

A function without `parameters` takes an empty object. The schema is the request's one structured output
constraint (structured_outputs.py: a response_format or a guided_* field beside it is a 400 naming both), and it
covers the whole output from its first token, as vLLM applies it: the output is all JSON, with no <think> block
and no Kimi markers (a grammar matches no special token), so a forced choice is served without the reasoning
parser and without the Kimi tool-call parser (serving.prepare_chat).

Calls get Kimi's ids, `functions.<name>:<n>`, n counting on from the calls already in the conversation (vLLM's
kimi_k2 ids): the chat template renders them back as they are in the next turn.

A named call streams as vLLM streams it: its id and name with the first delta, then its arguments as they are
generated. A required call is sent whole once its array element is complete (it parses then). Both modes feed one
of these streams delta by delta, so the stream put together is the whole response. An output cut short (max_tokens,
a stop string) keeps what it has: a named call's arguments are the text so far; for "required", the elements that
completed are the calls and the rest of the text is the content; finish_reason "length" says which.
"""

from __future__ import annotations

import json
from typing import Any, Union

from .errors import bad_request
from .protocol import ChatCompletionRequest, ChatTool, NamedToolChoice
from .tool_calls import ParsedCall, ParsedDelta, ToolCallDelta

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


# ---- the constraint ---------------------------------------------------------------------------
def forced_tool_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a forced tool choice puts on the output; None when the choice forces nothing. The request has
    checked that its tools hold the named function."""
    if isinstance(body.tool_choice, NamedToolChoice):
        return _parameters(next(t for t in body.tools if t.function.name == body.tool_choice.function.name))
    if body.tool_choice == "required":
        return _calls_schema(body.tools, body.max_tool_calls)
    return None


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or EMPTY_PARAMETERS


def _calls_schema(tools: list[ChatTool], max_calls: int | None) -> dict[str, Any]:
    """An array of at least one and at most `max_calls` (None: any number) calls of any of `tools` (vLLM's schema);
    their `$defs` go to the root, where a `$ref` "#/$defs/..." points from anywhere in the schema. Two tools defining
    one name differently are a 400."""
    defs: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        parameters = dict(_parameters(tool))  # a copy: the request's own schema stays as it was sent
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise bad_request(f'tool_choice "required": the tools define $defs {name!r} differently; one schema '
                                  f"must serve them all", "tools")
        alternatives.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                            "parameters": parameters},
                             "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


# ---- the output as calls ----------------------------------------------------------------------
def _call_id(name: str, number: int) -> str:
    return f"functions.{name}:{number}"


class NamedCallStream:
    """A named choice's output, read delta by delta: all of it is the one call's arguments."""

    shows_tool_calls = False  # its "stop" stays "stop" (OpenAI's and vLLM's finish_reason for a named choice)

    def __init__(self, name: str, first_number: int) -> None:
        self.name = name
        self.id = _call_id(name, first_number)
        self._arguments: list[str] = []

    def read(self, text: str) -> ParsedDelta:
        """The call's id and name with the first delta (arguments "" at least), its text after."""
        first = not self._arguments
        self._arguments.append(text)
        if first:
            return ParsedDelta(calls=[ToolCallDelta(0, text, self.id, self.name)])
        return ParsedDelta(calls=[ToolCallDelta(0, text)] if text else [])

    def finish(self) -> str:
        """What the end leaves as content: nothing."""
        return ""

    def result(self) -> tuple[str, list[ParsedCall]]:
        return "", [ParsedCall(self.id, self.name, "".join(self._arguments))]


class RequiredCallsStream:
    """A "required" choice's output, read delta by delta: each element of the JSON array, once complete, is a call.

    The scan follows JSON's nesting outside strings: an element starts with the "{" that opens depth 2 and is complete
    with the "}" that closes it. Text that is not one array (only a grammar that failed could write it) stops the
    reading: it is content."""

    def __init__(self, first_number: int) -> None:
        self.first_number = first_number
        self._text = ""
        self._depth = 0
        self._in_string = self._escaped = self._opened = self._broken = False
        self._element_start = 0
        self._consumed = 0  # the text up to here is calls (or the array's closing bracket)
        self._calls: list[ParsedCall] = []
        self._content = ""

    @property
    def shows_tool_calls(self) -> bool:
        return bool(self._calls)

    def read(self, text: str) -> ParsedDelta:
        """The calls this text completes, each whole in one piece."""
        out = ParsedDelta()
        start, self._text = len(self._text), self._text + text
        for position in range(start, len(self._text)):
            if self._broken:
                break
            self._scan(position, out)
        return out

    def _scan(self, position: int, out: ParsedDelta) -> None:
        char = self._text[position]
        if self._in_string:
            self._in_string = self._escaped or char != '"'
            self._escaped = not self._escaped and char == "\\"
        elif self._depth == 0 and not char.isspace():  # the array's "[", once
            self._broken = char != "[" or self._opened
            self._depth, self._opened = 1, True
        elif char == '"':
            self._in_string = True
        elif char in "[{":
            self._depth += 1
            if self._depth == 2 and char == "{":
                self._element_start = position
        elif char in "]}":
            self._depth -= 1
            if self._depth == 1 and char == "}":
                self._read_call(self._text[self._element_start : position + 1], position + 1, out)
            elif self._depth == 0 and char == "]":
                self._consumed = position + 1

    def _read_call(self, element: str, end: int, out: ParsedDelta) -> None:
        """A complete element -> a call; one that is not {"name": str, "parameters": ...} stops the reading."""
        try:
            call = json.loads(element)
            name, arguments = call["name"], json.dumps(call["parameters"], ensure_ascii=False)
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            self._broken = True
            return
        index = len(self._calls)
        self._calls.append(ParsedCall(_call_id(name, self.first_number + index), name, arguments))
        out.calls.append(ToolCallDelta(index, arguments, self._calls[-1].id, name))
        self._consumed = end

    def finish(self) -> str:
        """What the end leaves as content: the text after the last complete call, unless only whitespace (a whole
        array leaves nothing; no call, the whole text)."""
        rest = self._text[self._consumed :]
        self._content = rest if rest.strip() else ""
        return self._content

    def result(self) -> tuple[str, list[ParsedCall]]:
        return self._content, list(self._calls)


ForcedCallStream = Union[NamedCallStream, RequiredCallsStream]


def forced_call_stream(body: ChatCompletionRequest) -> ForcedCallStream | None:
    """A new stream for one choice of a request with a forced tool choice; None without one."""
    if not body.forces_tool_calls:
        return None
    first_number = sum(len(m.tool_calls or []) for m in body.messages if m.role == "assistant")
    if isinstance(body.tool_choice, NamedToolChoice):
        return NamedCallStream(body.tool_choice.function.name, first_number)
    return RequiredCallsStream(first_number)
