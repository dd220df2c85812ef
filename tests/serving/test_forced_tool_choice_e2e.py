"""Forced tool choice end to end, with the `openai` client, on real `k3serve serve` processes: the disaggregated
server (Ray, Mooncake, 1P1D: the prefill engine samples the first token under the constraint, the decode engine
the rest) and the colocated one.

Spec (the tiny model has random weights: only the constraint makes its output calls; the tools' parameters are
enums, booleans and bounded integers, so every call is short and ends):
- tool_choice naming a function: exactly one call, of that function, whose arguments parse and validate against
  its parameters; no content; finish_reason "stop" (OpenAI's and vLLM's for a named choice).
- tool_choice "required" with two tools: at least one call, each of one of the tools with arguments that validate
  against its parameters; no content; finish_reason "tool_calls". With parallel_tool_calls false, exactly one.
- Streamed, the calls the client puts together from the deltas are the whole response's (ids, names, arguments),
  with the same finish reason.
- A named function that is not among the tools is a 400 naming tool_choice.
"""

from __future__ import annotations

import json

import httpx
import pytest
jsonschema = pytest.importorskip("jsonschema")  # a test extra; the GPU machine has none

from _server_harness import Server
from test_bad_requests import assert_openai_error
from test_openai_e2e import MESSAGES, any_server, client_of  # noqa: F401 (any_server: a fixture)

PARAMETERS = {
    "set_light": {"type": "object", "properties": {"on": {"type": "boolean"},
                                                   "room": {"type": "string", "enum": ["kitchen", "hall"]}},
                  "required": ["on", "room"], "additionalProperties": False},
    "set_level": {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["level"], "additionalProperties": False},
}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in PARAMETERS.items()]
SAMPLED = {"temperature": 1.0, "seed": 3}  # seeded: the stream and the whole response sample the same output


def chat(server: Server, stream: bool, tool_choice: str | dict,
         **fields) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """(content, calls as (id, name, arguments), finish_reason) of one chat choice, as the openai client reads it,
    streamed or not; `fields`: more of the request's."""
    with client_of(server) as client:
        out = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS,
                                             tool_choice=tool_choice, stream=stream, **SAMPLED, **fields)
        if not stream:
            (choice,) = out.choices
            calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
            return choice.message.content, calls, choice.finish_reason
        chunks = [c for c in out if c.choices]
    content, calls = None, []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content = content + delta.content if delta.content else content  # the role chunk's "" is no content
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index == len(calls)
                calls.append([piece.id, piece.function.name, ""])
            calls[piece.index][2] += piece.function.arguments or ""
    return content, [tuple(c) for c in calls], chunks[-1].choices[0].finish_reason


def assert_valid(calls: list[tuple[str, str, str]]) -> None:
    for call_id, name, arguments in calls:
        assert call_id.startswith(f"functions.{name}:"), call_id
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.timeout(300)
def test_a_named_choice_is_one_valid_call_of_that_function(any_server: Server) -> None:
    named = {"type": "function", "function": {"name": "set_level"}}
    content, calls, finish = whole = chat(any_server, False, named)
    assert content is None and [name for _, name, _ in calls] == ["set_level"] and finish == "stop", whole
    assert_valid(calls)
    assert chat(any_server, True, named) == whole


@pytest.mark.timeout(300)
def test_required_calls_are_calls_of_the_tools_with_valid_arguments(any_server: Server) -> None:
    content, calls, finish = whole = chat(any_server, False, "required")
    assert content is None and calls and finish == "tool_calls", whole
    assert_valid(calls)
    assert chat(any_server, True, "required") == whole


@pytest.mark.timeout(300)
def test_required_without_parallel_calls_is_one_call(any_server: Server) -> None:
    content, calls, finish = whole = chat(any_server, False, "required", parallel_tool_calls=False)
    assert content is None and len(calls) == 1 and finish == "tool_calls", whole
    assert_valid(calls)
    assert chat(any_server, True, "required", parallel_tool_calls=False) == whole


@pytest.mark.timeout(120)
def test_a_function_not_among_the_tools_is_a_400(any_server: Server) -> None:
    body = {"model": any_server.model, "messages": MESSAGES, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "set_fan"}}}
    error = assert_openai_error(httpx.post(f"{any_server.url}/v1/chat/completions", json=body, timeout=60), 400)
    assert error["param"] == "tool_choice" and "'set_fan'" in error["message"], error
