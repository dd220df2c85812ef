"""/v1/responses through the real app and tokenizer, read by the OpenAI SDK (its own Response and event types):
text, reasoning and function calls, whole and streamed; the input items become the chat prompt; a request it
cannot serve is a 400.

As in test_tool_calls_api.py, a scripted EngineClient answers every request with the same token ids (here a think
block, text and two Kimi tool calls); one real-engine test checks the usage and a plain answer."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import httpx
import pytest
openai = pytest.importorskip("openai")  # a test extra; the GPU machine has none
from prometheus_client import CollectorRegistry

from k3serve.cluster.api import build_app
from k3serve.cluster.metrics import IngressMetrics

from test_api import assert_error
from test_tool_calls_api import TWO_CALLS, WEATHER_ARGS, ScriptedEngine, anyio_backend, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio

THOUGHT = "The user wants two things."
REPLY = f"<think>{THOUGHT}</think>{TWO_CALLS}"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in TOOLS]


@pytest.fixture
def scripted(tokenizer) -> ScriptedEngine:  # noqa: F811
    engine = ScriptedEngine(tokenizer)
    engine.reply = tokenizer.encode(REPLY)
    return engine


@contextlib.asynccontextmanager
async def sdk(engine) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    app = build_app(engine, IngressMetrics(CollectorRegistry(), model_name=engine.model_name))
    transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress")
    async with transport, openai.AsyncOpenAI(api_key="-", base_url="http://ingress/v1", http_client=transport) as c:
        yield c, transport


async def test_a_response_has_reasoning_text_and_calls_as_output_items(scripted):
    async with sdk(scripted) as (client, _):
        r = await client.responses.create(model="k3-tiny", input="Weather and time in Paris?", tools=TOOLS,
                                          instructions="Be brief.", max_output_tokens=200)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed" and r.model == "k3-tiny"
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, weather, time_call = r.output
    assert reasoning.content[0].text == THOUGHT
    assert message.role == "assistant" and message.content[0].text == "Let me check." == r.output_text
    assert (weather.name, weather.arguments, weather.call_id) == ("get_weather", WEATHER_ARGS, "functions.get_weather:0")
    assert (time_call.name, time_call.arguments) == ("get_time", "{}")
    assert r.usage.output_tokens == len(scripted.reply) and r.usage.input_tokens == len(scripted.requests[0].prompt)
    assert r.usage.output_tokens_details.reasoning_tokens > 0 and r.usage.input_tokens_details.cached_tokens == 0
    assert r.instructions == "Be brief." and [t.name for t in r.tools] == ["get_weather", "get_time"]


async def test_the_input_items_are_the_chat_prompt(scripted, tokenizer):  # noqa: F811
    """instructions a system turn; a past call and its output as the assistant's tool call and a tool message."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "functions.get_weather:0", "name": "get_weather",
              "arguments": WEATHER_ARGS},
             {"type": "function_call_output", "call_id": "functions.get_weather:0", "output": "sunny"},
             {"role": "developer", "content": "Answer in French."}]
    async with sdk(scripted) as (client, _):
        await client.responses.create(model="k3-tiny", input=items, instructions="Be brief.", tools=TOOLS)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}]},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
                {"role": "system", "content": "Answer in French."}]
    assert scripted.requests[0].prompt == tokenizer.encode_chat(messages, tools=CHAT_TOOLS)


async def test_a_streamed_response_sends_openais_events_in_order(scripted):
    async with sdk(scripted) as (client, _):
        stream = await client.responses.create(model="k3-tiny", input="Weather and time in Paris?", tools=TOOLS,
                                               stream=True)
        events = [event async for event in stream]
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [item.type for item in done] == ["reasoning", "message", "function_call", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me check."
    arguments = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == [WEATHER_ARGS, "{}"]
    final = events[-1].response
    assert final.status == "completed" and [i.type for i in final.output] == added
    assert final.output_text == "Let me check." and final.usage.output_tokens == len(scripted.reply)
    async with sdk(scripted) as (client, _):
        whole = await client.responses.create(model="k3-tiny", input="Weather and time in Paris?", tools=TOOLS)
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [i.model_dump(exclude={"id"}) for i in whole.output]


async def test_a_cut_answer_is_incomplete(scripted):
    async with sdk(scripted) as (client, _):
        r = await client.responses.create(model="k3-tiny", input="Weather?", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "image_generation_call"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "model": "another-model"}, "model"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
    ({}, "input"),
], ids=["previous-response", "web-search-tool", "unknown-item", "image-part", "bad-role", "empty-input",
        "other-model", "bad-temperature", "bad-format", "no-input"])
async def test_what_it_cannot_serve_is_a_clear_error(scripted, body, param):
    async with sdk(scripted) as (_, http):
        r = await http.post("/v1/responses", json=body)
    assert assert_error(r, 404 if param == "model" else 400)["param"] == param


async def test_a_real_engines_plain_answer(http, client, engine):
    """The tiny model on the real engine (tests/cluster/conftest.py's): its usage the chat's."""
    r = await http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, "temperature": 0.0,
                                                "reasoning": {"effort": None}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["output_tokens"] == 4 and body["status"] == "incomplete"
    assert body["usage"]["input_tokens"] == len(client.tokenizer.encode_chat([{"role": "user", "content": "hi"}]))
