"""A forced tool choice on /v1/chat/completions (tool_choice "required" or a named function), at the ingress.

Spec:
- The choice is the request's structured output constraint, vLLM's schema: a named function's `parameters` (an
  empty object without them); for "required" an array of at least one {"name", "parameters"} of any tool, the
  tools' `$defs` at its root. It parses as xgrammar reads it and validates what it should.
- Refused with a 400 naming the field: no tools, a name not among them, a wrong shape, and a forced choice beside
  response_format json / guided_* (naming both); on /v1/completions, which has no tools.
- The output comes back as tool calls with Kimi ids counting on from the conversation's: named, one call whose
  arguments are the output ("stop" stays); required, a call an element ("tool_calls"). Streamed, a named call's
  arguments arrive as generated, a required call once its element is complete; the stream put together is the
  whole response. Cut short, the complete calls stay and the rest is content.

The scripted engine (test_tool_calls_api.py) writes the JSON a constrained model would, applying no grammar; the
real engines' constrained output: tests/serving/test_forced_tool_choice_e2e.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
jsonschema = pytest.importorskip("jsonschema")  # a test extra; the GPU machine has none

from k3serve.cluster.api.forced_tool_choice import EMPTY_PARAMETERS, RequiredCallsStream
from k3serve.cluster.api.protocol import ChatCompletionRequest
from k3serve.cluster.api.structured_outputs import structured_outputs_of
from k3serve.engine.sampling_params import StructuredOutputsParams
from k3serve.engine.constraint import parse_constraint
from k3serve.model.tokenizer import Tokenizer

from test_api import assert_error, parse_sse
from test_tool_calls_api import ASK, CHAT, EXPECTED_CALLS, TOOLS, ScriptedEngine, ingress, streamed_calls

WEATHER = TOOLS[0]["function"]["parameters"]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_ARGS = '{"city": "Paris"}'
CALLS = ('[{"name": "get_weather", "parameters": {"city": "Pa}ri\\"s"}},\n'
         ' {"name": "get_time", "parameters": {}}]')  # a brace and an escaped quote inside a string
FIRST_END = CALLS.index("}},") + 2  # the first element's end
CALLED = [{"id": "functions.get_weather:0", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Pa}ri\\"s"}'}},
          {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


def scripted(tokenizer: Tokenizer, reply: str = "") -> ScriptedEngine:
    """A scripted engine whose model writes `reply`."""
    engine = ScriptedEngine(tokenizer)
    engine.reply = tokenizer.encode(reply)
    return engine


def schema_of(**fields) -> dict:
    constraint = structured_outputs_of(ChatCompletionRequest(messages=ASK, **fields))
    assert constraint.kind == "json"
    parse_constraint(constraint)  # xgrammar reads it
    return json.loads(constraint.json)


# ---- the constraint ---------------------------------------------------------------------------
def test_a_named_choice_constrains_the_output_to_the_functions_parameters():
    assert schema_of(tools=TOOLS, tool_choice=NAMED) == WEATHER
    bare = [{"type": "function", "function": {"name": "ping"}}]
    assert schema_of(tools=bare, tool_choice={"type": "function", "function": {"name": "ping"}}) == EMPTY_PARAMETERS


def test_required_constrains_the_output_to_an_array_of_calls_of_any_tool():
    schema = schema_of(tools=TOOLS, tool_choice="required")
    assert schema == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER},
         "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": TOOLS[1]["function"]["parameters"]},
         "required": ["name", "parameters"]}]}}
    jsonschema.validate(json.loads(CALLS), schema)
    for wrong in ([], [{"name": "get_news", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


@pytest.mark.parametrize("parallel", [None, True])
def test_required_with_parallel_calls_has_no_upper_bound(parallel):
    assert "maxItems" not in schema_of(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)


def test_required_without_parallel_calls_is_an_array_of_one_call():
    """parallel_tool_calls false: vLLM's schema gets maxItems 1; a named choice is one call anyway."""
    schema = schema_of(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert schema == {**schema_of(tools=TOOLS, tool_choice="required"), "maxItems": 1}
    jsonschema.validate(json.loads(CALLS)[:1], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(CALLS), schema)
    assert schema_of(tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False) == WEATHER


def test_required_puts_the_tools_defs_at_the_root_where_their_refs_point():
    city = {"type": "string", "enum": ["Paris", "Oslo"]}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}, "$defs": {"city": city}}}}
        for i in range(2)]
    sent = copy.deepcopy(tools)
    schema = schema_of(tools=tools, tool_choice="required")
    assert schema["$defs"] == {"city": city}
    assert all("$defs" not in alternative["properties"]["parameters"] for alternative in schema["items"]["anyOf"])
    jsonschema.validate([{"name": "f1", "parameters": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f1", "parameters": {"city": "Rome"}}], schema)
    assert tools == sent  # the request's own schemas are left as they came


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_a_choice_that_forces_nothing_constrains_nothing(tool_choice):
    assert structured_outputs_of(ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice=tool_choice)) is None


# ---- refused ----------------------------------------------------------------------------------
def _with_defs(name: str, city: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"$defs": {"city": city}}}}


REFUSALS = {  # id: (request fields, the param of the 400, words of its message)
    "required-without-tools": ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    "named-without-tools": ({"tool_choice": NAMED}, "tool_choice", "needs `tools`"),
    "required-with-an-empty-tool-list": ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs `tools`"),
    "named-not-among-the-tools": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
                                  "tool_choice", "'f', which is not among `tools` (get_weather, get_time)"),
    "named-without-a-name": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice",
                             "name"),
    "not-a-choice": ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "required"),
    "defs-that-differ": ({"tools": [_with_defs("a", {"type": "string"}), _with_defs("b", {"type": "integer"})],
                          "tool_choice": "required"}, "tools", "$defs 'city' differently"),
    # a forced choice is the output's constraint: another one beside it is refused naming both
    "required-and-json_object": ({"tools": TOOLS, "tool_choice": "required",
                                  "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    "named-and-json_schema": ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": WEATHER}}}, "tool_choice", "response_format"),
    "named-and-guided_regex": ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a+"}, "tool_choice",
                               "guided_regex"),
    "required-and-guided_json": ({"tools": TOOLS, "tool_choice": "required", "guided_json": WEATHER}, "tool_choice",
                                 "guided_json"),
    "named-and-structured_outputs": ({"tools": TOOLS, "tool_choice": NAMED, "structured_outputs": {"choice": ["a"]}},
                                     "tool_choice", "structured_outputs"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("fields,param,words", REFUSALS.values(), ids=REFUSALS.keys())
async def test_a_forced_choice_it_cannot_serve_is_a_400(tokenizer, fields, param, words):
    engine = scripted(tokenizer)
    async with ingress(engine) as http:
        error = assert_error(await http.post(CHAT, json={"messages": ASK, **fields}), 400, param=param)
    assert words in error["message"] and param in error["message"], error
    assert engine.requests == []


@pytest.mark.anyio
async def test_completions_refuse_a_forced_choice(tokenizer):
    async with ingress(scripted(tokenizer)) as http:
        r = await http.post("/v1/completions", json={"prompt": "hi", "tool_choice": "required"})
    assert_error(r, 400, param="tool_choice", message="/v1/chat/completions")


# ---- the output as calls ----------------------------------------------------------------------
async def whole_and_streamed(http, **fields) -> tuple[dict, list[dict]]:
    """The response's choice, and the stream's chunks, of one request."""
    body = {"messages": ASK, "tools": TOOLS, **fields}
    whole = (await http.post(CHAT, json=body)).json()["choices"][0]
    return whole, parse_sse((await http.post(CHAT, json={**body, "stream": True})).text)


def assert_stream_is_whole(chunks: list[dict], whole: dict) -> None:
    """The stream put together is the whole response: content, calls, finish reason."""
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == (whole["message"]["content"] or "")
    assert streamed_calls(chunks) == whole["message"].get("tool_calls", [])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == whole["finish_reason"] and not any(reasons[:-1])


@pytest.mark.anyio
async def test_a_named_choice_is_one_call_whose_arguments_stream_as_generated(tokenizer):
    engine = scripted(tokenizer, WEATHER_ARGS + "<|im_end|>")
    async with ingress(engine) as http:
        whole, chunks = await whole_and_streamed(http, tool_choice=NAMED)
    call = {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}
    assert whole["message"] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert whole["finish_reason"] == "stop"  # OpenAI's and vLLM's reason for a named choice
    pieces = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls", [])]
    assert pieces[0]["id"] == call["id"] and len(pieces) > 3  # the header first, then the arguments piece by piece
    assert_stream_is_whole(chunks, whole)
    request = engine.requests[0]
    assert request.prompt == engine.tokenizer.encode_chat(ASK, tools=TOOLS)  # the model still sees the tools
    assert request.sampling_params.structured_outputs == StructuredOutputsParams(json=WEATHER)
    assert not request.sampling_params.keep_special_token_ids  # no Kimi markers to read: the output is JSON


@pytest.mark.anyio
async def test_required_is_a_call_an_element_each_sent_once_complete(tokenizer):
    engine = scripted(tokenizer, CALLS + "<|im_end|>")
    async with ingress(engine) as http:
        whole, chunks = await whole_and_streamed(http, tool_choice="required")
        both = (await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "tool_choice": "required", "n": 2}))
    assert whole["message"] == {"role": "assistant", "content": None, "tool_calls": CALLED}
    assert whole["finish_reason"] == "tool_calls"
    assert_stream_is_whole(chunks, whole)
    sent = [i for i, c in enumerate(chunks) for _ in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len(sent) == 2 and sent[0] < sent[1]  # the first call went out before the second was written
    assert [c["message"]["tool_calls"] for c in both.json()["choices"]] == [CALLED] * 2  # each choice its own


@pytest.mark.anyio
async def test_call_ids_count_on_from_the_calls_in_the_conversation(tokenizer):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": EXPECTED_CALLS},
                *({"role": "tool", "tool_call_id": call["id"], "content": "ok"} for call in EXPECTED_CALLS)]
    engine = scripted(tokenizer, CALLS + "<|im_end|>")
    async with ingress(engine) as http:
        required = (await http.post(CHAT, json={"messages": messages, "tools": TOOLS, "tool_choice": "required"}))
        named = (await http.post(CHAT, json={"messages": messages, "tools": TOOLS, "tool_choice": NAMED}))
    assert [c["id"] for c in required.json()["choices"][0]["message"]["tool_calls"]] == \
        ["functions.get_weather:2", "functions.get_time:3"]
    assert named.json()["choices"][0]["message"]["tool_calls"][0]["id"] == "functions.get_weather:2"


@pytest.mark.anyio
@pytest.mark.parametrize("cut_after,calls", [(CALLS.index(' {"name": "get_time"'), CALLED[:1]),
                                             (CALLS.index("Pa}"), [])],
                         ids=["in-the-second-element", "in-the-first-element"])
async def test_a_required_output_cut_short_keeps_its_complete_calls(tokenizer, cut_after, calls):
    """max_tokens ends it inside an element: the complete calls stay, the rest of the text is the content."""
    engine = scripted(tokenizer, CALLS)
    max_tokens = next(n for n in range(1, len(engine.reply)) if len(tokenizer.decode(engine.reply[:n])) > cut_after + 2)
    text = tokenizer.decode(engine.reply[:max_tokens])
    async with ingress(engine) as http:
        whole, chunks = await whole_and_streamed(http, tool_choice="required", max_tokens=max_tokens)
    rest = text[FIRST_END:] if calls else text
    assert whole["message"] == {"role": "assistant", "content": rest, **({"tool_calls": calls} if calls else {})}
    assert whole["finish_reason"] == "length"
    assert_stream_is_whole(chunks, whole)


@pytest.mark.anyio
async def test_a_named_output_cut_short_is_the_arguments_so_far(tokenizer):
    engine = scripted(tokenizer, WEATHER_ARGS)
    async with ingress(engine) as http:
        whole, chunks = await whole_and_streamed(http, tool_choice=NAMED, max_tokens=3)
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["arguments"] == tokenizer.decode(engine.reply[:3])
    assert whole["finish_reason"] == "length"
    assert_stream_is_whole(chunks, whole)


# ---- the reading, piece by piece ----------------------------------------------------------------
def read_all(text: str, step: int) -> tuple[str, list]:
    stream = RequiredCallsStream(0)
    for start in range(0, len(text), step):
        stream.read(text[start : start + step])
    stream.finish()
    return stream.result()


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_any_split_of_the_text_reads_the_same_calls(step):
    content, calls = read_all(CALLS, step)
    assert content == "" and [(c.id, c.name, c.arguments) for c in calls] == \
        [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in CALLED]


GET_TIME = '{"name": "get_time", "parameters": {}}'
NOT_CALLS = {  # id: (text, its content, its number of calls)
    "an-object": (GET_TIME, GET_TIME, 0),
    "text": ("Sure.", "Sure.", 0),
    "an-element-without-parameters": ('[{"name": "get_time"}]', '[{"name": "get_time"}]', 0),
    "two-arrays": (f"[{GET_TIME}] [{GET_TIME}]", f" [{GET_TIME}]", 1),
}


@pytest.mark.parametrize("text,content,num_calls", NOT_CALLS.values(), ids=NOT_CALLS.keys())
def test_text_that_is_not_one_array_of_calls_is_content(text, content, num_calls):
    """Only a grammar that failed could write it: from where it breaks on, it is content."""
    got, calls = read_all(text, 3)
    assert (got, len(calls)) == (content, num_calls)
