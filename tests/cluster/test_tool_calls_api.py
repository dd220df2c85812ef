"""Tool calling on /v1/chat/completions, through the real app and the real tokenizer.

The tiny random model never writes a tool call, so the backend here is a scripted `EngineClient`: it answers
every request with the same token ids (Kimi's tool-call format encoded by the real tokenizer, special tokens
included), detokenized the way the engine does it, under the request's own sampling params (so a request that
dropped the special tokens would lose the markers), one token a delta, ending with <|im_end|> or at max_tokens."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from k3serve.cluster.api import build_app
from k3serve.cluster.api.tool_calls import MARKERS
from k3serve.cluster.metrics import IngressMetrics
from k3serve.engine.detokenizer import IncrementalDetokenizer
from k3serve.engine.outputs import RequestDelta
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.tokenizer import Tokenizer

from test_api import assert_error, parse_sse

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
TWO_CALLS = ("Let me check.<|tool_calls_section_begin|>"
             f"<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{WEATHER_ARGS}<|tool_call_end|>"
             "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
             "<|tool_calls_section_end|><|im_end|>")
EXPECTED_CALLS = [
    {"id": "functions.get_weather:0", "type": "function",
     "function": {"name": "get_weather", "arguments": WEATHER_ARGS}},
    {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]


class ScriptedEngine:
    """An EngineClient whose model answers `reply` to every request; it keeps the requests it got."""

    model_name, max_model_len = "k3-tiny", 4096

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.reply: list[int] = []
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        self.requests.append(request)
        params = request.sampling_params
        detok = IncrementalDetokenizer.for_request(self.tokenizer, request.prompt, params)  # as the engine does
        reply = self.reply[: params.max_tokens]
        for n, token in enumerate(reply, 1):
            text, last = detok.push(token), n == len(reply)
            stopped = token in self.tokenizer.stop_token_ids
            yield RequestDelta(request.request_id, [token], text + (detok.finish() if last else ""), finished=last,
                               finish_reason=("stop" if stopped else "length") if last else None, logprobs=None,
                               num_prompt_tokens=len(request.prompt), num_output_tokens=n,
                               stop_reason=token if last and stopped else None)

    async def abort(self, request_id: str) -> None:
        pass

    async def check_health(self) -> None:
        pass


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


@pytest.fixture
def engine(tokenizer: Tokenizer) -> ScriptedEngine:
    engine = ScriptedEngine(tokenizer)
    engine.reply = tokenizer.encode(TWO_CALLS)
    assert tokenizer.special_token_id("<|tool_call_argument_begin|>") in engine.reply  # one token, not text
    return engine


@contextlib.asynccontextmanager
async def ingress(engine: ScriptedEngine, **app_options) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the real app over `engine` (`app_options`: build_app's, e.g. reasoning_parser)."""
    app = build_app(engine, IngressMetrics(CollectorRegistry(), model_name=engine.model_name), **app_options)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as c:
        yield c


@pytest.fixture
async def http(engine: ScriptedEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with ingress(engine) as c:
        yield c


def streamed_calls(chunks: list[dict], index: int = 0) -> list[dict]:
    """The tool calls of choice `index` as a client assembles them from the stream's pieces."""
    calls: list[dict] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            for piece in choice["delta"].get("tool_calls", []) if choice["index"] == index else []:
                if "id" in piece:
                    assert piece["index"] == len(calls) and piece["type"] == "function"
                    assert set(piece["function"]) == {"name", "arguments"}
                    calls.append({"id": piece["id"], "type": "function", "function": dict(piece["function"])})
                else:
                    assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
                    calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return calls


async def test_the_calls_come_back_as_message_tool_calls(http, engine, tokenizer):
    r = await http.post(CHAT, json={"messages": ASK, "tools": TOOLS})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Let me check.", "tool_calls": EXPECTED_CALLS}
    assert choice["finish_reason"] == "tool_calls"
    assert choice["stop_reason"] == tokenizer.special_token_id("<|im_end|>")
    assert r.json()["usage"]["completion_tokens"] == len(engine.reply)


async def test_the_prompt_declares_the_tools_and_the_markers_are_kept(http, engine, tokenizer):
    await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "tool_choice": "auto"})
    (request,) = engine.requests
    assert request.prompt == tokenizer.encode_chat(ASK, tools=TOOLS)
    assert request.prompt != tokenizer.encode_chat(ASK)
    params, specials = request.sampling_params, tokenizer.special_tokens
    assert params.skip_special_tokens  # every other special token still skipped token by token
    assert {specials[m] for m in MARKERS} <= set(params.keep_special_token_ids)


async def test_the_stream_sends_each_call_by_index_then_its_arguments_in_pieces(http, engine):
    r = await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "stream": True,
                                    "stream_options": {"include_usage": True}})
    *chunks, usage = parse_sse(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == "Let me check."
    assert streamed_calls(chunks) == EXPECTED_CALLS
    weather_pieces = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls", []) if p["index"] == 0]
    assert len(weather_pieces) > 5  # the JSON arrives as it is generated, not at the end
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "tool_calls" and not any(reasons[:-1])
    assert usage["usage"]["completion_tokens"] == len(engine.reply)
    whole = (await http.post(CHAT, json={"messages": ASK, "tools": TOOLS})).json()["choices"][0]["message"]
    assert whole == {"role": "assistant", "content": content, "tool_calls": streamed_calls(chunks)}


async def test_each_choice_parses_its_own_calls(http):
    r = await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "n": 2, "stream": True})
    chunks = parse_sse(r.text)
    assert streamed_calls(chunks, 0) == streamed_calls(chunks, 1) == EXPECTED_CALLS
    whole = (await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "n": 2})).json()
    assert [c["message"]["tool_calls"] for c in whole["choices"]] == [EXPECTED_CALLS] * 2


async def test_without_a_reasoning_parser_the_calls_come_back_alike(engine):
    """Then the tool-call parser reads the text without the reasoning parser before it."""
    async with ingress(engine, reasoning_parser="none") as http:
        whole = (await http.post(CHAT, json={"messages": ASK, "tools": TOOLS})).json()["choices"][0]
        chunks = parse_sse((await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "stream": True})).text)
    assert whole["message"] == {"role": "assistant", "content": "Let me check.", "tool_calls": EXPECTED_CALLS}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Let me check."
    assert streamed_calls(chunks) == EXPECTED_CALLS and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_reply_without_calls_is_plain_content(http, engine, tokenizer):
    engine.reply = tokenizer.encode("It is sunny.<|im_end|>")
    for stream in (False, True):
        r = await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "stream": stream})
        if stream:
            chunks = parse_sse(r.text)
            assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "It is sunny."
            assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        else:
            (choice,) = r.json()["choices"]
            assert choice["message"] == {"role": "assistant", "content": "It is sunny."}  # no tool_calls key
            assert choice["finish_reason"] == "stop"


def condensed(chunks: list[dict]) -> list[tuple[dict, str | None]]:
    """Choice 0's (delta, finish_reason) a chunk, a delta that continues the one before merged into it (with its
    finish reason): content after content, a call's argument text after its own. The order and the text of
    everything sent, whatever the pieces the tokens cut it into."""
    out: list[tuple[dict, str | None]] = []
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta, last = copy.deepcopy(choice["delta"]), out[-1][0] if out else {}
        if set(delta) == set(last) == {"content"}:
            last["content"] += delta["content"]
        elif set(delta) == set(last) == {"tool_calls"} and _arguments(delta) and _arguments(last) and \
                delta["tool_calls"][0]["index"] == last["tool_calls"][0]["index"]:
            last["tool_calls"][0]["function"]["arguments"] += delta["tool_calls"][0]["function"]["arguments"]
        else:
            out.append((delta, choice["finish_reason"]))
            continue
        out[-1] = (last, choice["finish_reason"])
    return out


def _arguments(delta: dict) -> bool:
    """A delta of one piece of argument text (no id: not a call's first piece)."""
    return len(delta["tool_calls"]) == 1 and "id" not in delta["tool_calls"][0]


def header(call: dict) -> dict:
    """The first call's first piece on the wire."""
    return {"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": ""}}]}


def arguments(text: str) -> dict:
    """Argument text of the first call on the wire."""
    return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}


ROLE = {"role": "assistant", "content": ""}


async def test_a_call_cut_by_max_tokens_is_the_call_so_far_in_both_modes(http, engine, tokenizer):
    """The stream sent the call's header and arguments before max_tokens cut it: it stays a call in the whole
    response too (arguments so far, as OpenAI returns them), and the reason stays "length"."""
    begin = engine.reply.index(tokenizer.special_token_id("<|tool_call_argument_begin|>")) + 1
    so_far = tokenizer.decode(engine.reply[begin : begin + 2])
    assert so_far == '{"'
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": begin + 2}
    whole = (await http.post(CHAT, json=body)).json()["choices"][0]
    cut = {**EXPECTED_CALLS[0], "function": {"name": "get_weather", "arguments": so_far}}
    assert whole["message"] == {"role": "assistant", "content": "Let me check.", "tool_calls": [cut]}
    assert whole["finish_reason"] == "length"
    chunks = parse_sse((await http.post(CHAT, json={**body, "stream": True})).text)
    assert condensed(chunks) == [(ROLE, None), ({"content": "Let me check."}, None), (header(cut), None),
                                 (arguments(so_far), "length")]


async def test_a_malformed_call_after_a_good_one_keeps_the_good_one_in_both_modes(http, engine, tokenizer):
    """The stream sent the good call whole before the second call's header turned out not to be `name:index`: it
    cannot take it back, and the whole response keeps it too (as vLLM's kimi_k2 parser, whole and streamed); from the
    break on, the text is content in both modes (vLLM drops it). A call was made: "tool_calls"."""
    good = f"<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{WEATHER_ARGS}<|tool_call_end|>"
    bad = "<|tool_call_begin|>get time<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
    engine.reply = tokenizer.encode(f"Let me check.<|tool_calls_section_begin|>{good}{bad}<|im_end|>")
    whole = (await http.post(CHAT, json={"messages": ASK, "tools": TOOLS})).json()["choices"][0]
    assert whole == {"index": 0, "logprobs": None, "finish_reason": "tool_calls",
                     "stop_reason": tokenizer.special_token_id("<|im_end|>"),
                     "message": {"role": "assistant", "content": "Let me check." + bad,
                                 "tool_calls": EXPECTED_CALLS[:1]}}
    chunks = parse_sse((await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "stream": True})).text)
    assert condensed(chunks) == [(ROLE, None), ({"content": "Let me check."}, None),
                                 (header(EXPECTED_CALLS[0]), None), (arguments(WEATHER_ARGS), None),
                                 ({"content": bad}, None), ({}, "tool_calls")]
    assert chunks[-1]["choices"][0]["stop_reason"] == whole["stop_reason"]


@pytest.mark.parametrize("stream", [False, True])
async def test_parallel_tool_calls_false_returns_the_first_call_only(http, stream):
    """As vLLM: the calls the model makes past the first are dropped, whole or streamed (never sent)."""
    r = await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "parallel_tool_calls": False, "stream": stream})
    if stream:
        chunks = parse_sse(r.text)
        assert condensed(chunks) == [(ROLE, None), ({"content": "Let me check."}, None),
                                     (header(EXPECTED_CALLS[0]), None), (arguments(WEATHER_ARGS), None),
                                     ({}, "tool_calls")]
    else:
        (choice,) = r.json()["choices"]
        assert choice["message"] == {"role": "assistant", "content": "Let me check.", "tool_calls": EXPECTED_CALLS[:1]}
        assert choice["finish_reason"] == "tool_calls"


async def test_parallel_tool_calls_true_is_every_call(http):
    r = await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "parallel_tool_calls": True})
    assert r.json()["choices"][0]["message"]["tool_calls"] == EXPECTED_CALLS


async def test_a_malformed_reply_streams_as_content_what_the_whole_response_returns(http, engine, tokenizer):
    """A header that is not `name:index`: no call at all, in either mode; the stream's content, put together, is the
    whole response's content, markers and all (the stop token dropped)."""
    text = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>get weather<|tool_call_argument_begin|>"
            f"{WEATHER_ARGS}<|tool_call_end|><|tool_calls_section_end|>")
    engine.reply = tokenizer.encode(text + "<|im_end|>")
    whole = (await http.post(CHAT, json={"messages": ASK, "tools": TOOLS})).json()["choices"][0]
    assert whole["message"] == {"role": "assistant", "content": text} and whole["finish_reason"] == "stop"
    chunks = parse_sse((await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "stream": True})).text)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_tool_choice_none_hides_the_tools(http, engine, tokenizer):
    engine.reply = tokenizer.encode("Sunny.<|im_end|>")
    r = await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "tool_choice": "none"})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Sunny."}
    (request,) = engine.requests
    assert request.prompt == tokenizer.encode_chat(ASK)


@pytest.mark.parametrize("tools", [{}, {"tools": None}, {"tools": []}], ids=["no-tools", "tools-null", "tools-empty"])
async def test_tool_choice_auto_without_tools_is_a_400(http, engine, tools):
    """As vLLM ("When using `tool_choice`, `tools` must be set."); the forced choices: test_tool_calls_forced.py."""
    r = await http.post(CHAT, json={"messages": ASK, "tool_choice": "auto", **tools})
    assert_error(r, 400, param="tool_choice", message="tool_choice: 'auto' needs `tools`")
    assert engine.requests == []


@pytest.mark.parametrize("tools", [{}, {"tools": None}], ids=["no-tools", "tools-null"])
async def test_tool_choice_none_without_tools_is_a_plain_chat(http, engine, tokenizer, tools):
    engine.reply = tokenizer.encode("Sunny.<|im_end|>")
    r = await http.post(CHAT, json={"messages": ASK, "tool_choice": "none", **tools})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Sunny."}
    assert engine.requests[0].prompt == tokenizer.encode_chat(ASK)


async def test_the_turn_after_a_call_renders_the_call_and_its_result(http, engine, tokenizer):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": EXPECTED_CALLS[:1]},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"sky": "clear"}'}]
    r = await http.post(CHAT, json={"messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    (request,) = engine.requests
    assert request.prompt == tokenizer.encode_chat(messages, tools=TOOLS)
    prompt = tokenizer.decode(request.prompt)
    assert (f"<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{WEATHER_ARGS}<|tool_call_end|>"
            in prompt)
    assert '## Return of functions.get_weather:0\n    {"sky": "clear"}<|im_end|>' in prompt


FUNCTION = {"name": "f", "parameters": {"type": "object"}}
BAD_REQUESTS = {
    "tools-not-a-list": ({"tools": {"type": "function", "function": FUNCTION}}, "tools"),
    "tools-not-a-function": ({"tools": [{"type": "retrieval"}]}, "tools"),
    "tools-without-a-name": ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    "tools-misspelt-key": ({"tools": [{"type": "function", "function": {"name": "f", "parameter": {}}}]}, "tools"),
    "tools-parameters-not-an-object": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
                                       "tools"),
    "functions": ({"functions": [FUNCTION]}, "functions"),
    "parallel_tool_calls-not-a-bool": ({"tools": TOOLS, "parallel_tool_calls": "sometimes"}, "parallel_tool_calls"),
    "tool-message-without-its-call": ({"messages": [*ASK, {"role": "tool", "content": "42"}]}, "messages"),
    "tool_calls-on-a-user-message": ({"messages": [{"role": "user", "content": "x", "tool_calls": EXPECTED_CALLS}]},
                                     "messages"),
}


@pytest.mark.parametrize("payload,param", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
async def test_bad_tool_requests_are_400(http, engine, payload, param):
    assert_error(await http.post(CHAT, json={"messages": ASK, **payload}), 400, param=param)
    assert engine.requests == []
