"""Kimi K3's chat format on /v1/chat/completions, through the real app, the K3-format tokenizer and the `openai` client.

The backend is the scripted EngineClient of test_tool_calls_api.py (the tiny random model never writes XTML): it
answers each request with one text of the vLLM golden corpus (tests/data/k3_parser_goldens.json), encoded by the real
tokenizer (markers as their special ids) and detokenized under the request's own sampling params. Every case comes
back, streamed and whole, with vLLM's `reasoning`, `content` and `tool_calls` (or, in the few cases where vLLM's whole
parse drops text its stream sent, the stream's reading: test_k3_parser_goldens.STREAM_READINGS). The prompt is K3's (thinking by
`chat_template_kwargs` and `reasoning_effort`); what K3 cannot honour is a 400 naming the field.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import AsyncIterator, get_args

import httpx
import pytest
openai = pytest.importorskip("openai")  # a test extra; the GPU machine has none
from prometheus_client import CollectorRegistry

from k3serve.cluster.api import build_app
from k3serve.cluster.api.parsers import REASONING_PARSER_CHOICES, TOOL_CALL_PARSER_CHOICES, chat_parsers
from k3serve.cluster.config import ServeConfig
from k3serve.cluster.metrics import IngressMetrics
from k3serve.model.tokenizer import Tokenizer, train_tiny_tokenizer

from test_api import assert_error
from test_k3_parser_goldens import expected_of
from test_tool_calls_api import ScriptedEngine

pytestmark = pytest.mark.anyio

GOLDENS = json.loads((Path(__file__).parent.parent / "data" / "k3_parser_goldens.json").read_text("utf-8"))["cases"]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
         for n in ("get_weather", "get_time", "configure", "f", "ping", "a&b")]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("k3-xtml-tokenizer")
    train_tiny_tokenizer(out, vocab_size=512, chat_format="kimi_k3")
    return Tokenizer.from_dir(out)


@pytest.fixture
def engine(tokenizer: Tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tokenizer)


@contextlib.asynccontextmanager
async def sdk(engine: ScriptedEngine, **app_options) -> AsyncIterator[openai.AsyncOpenAI]:
    app = build_app(engine, IngressMetrics(CollectorRegistry(), model_name=engine.model_name), **app_options)
    transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress/v1")
    async with transport, openai.AsyncOpenAI(api_key="-", base_url="http://ingress/v1", http_client=transport) as c:
        yield c


def _request(case: dict) -> dict:
    thinking = {"chat_template_kwargs": {"thinking": case["thinking"]}}
    fields = {"model": "k3-tiny", "messages": ASK, "extra_body": thinking}
    return {**fields, "tools": TOOLS} if case["tools"] else fields


def _calls(message_calls) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in message_calls or []]


@pytest.mark.parametrize("case", GOLDENS, ids=[case["name"] for case in GOLDENS])
async def test_each_golden_text_comes_back_as_vllm_parses_it(engine, tokenizer, case):
    engine.reply = tokenizer.encode(case["text"]) + [tokenizer.special_token_id("<|end_of_msg|>")]
    expected = expected_of(case)
    async with sdk(engine) as client:
        whole = (await client.chat.completions.create(**_request(case))).choices[0]
        stream = await client.chat.completions.create(**_request(case), stream=True)
        chunks = [chunk.choices[0] async for chunk in stream if chunk.choices]
    message = whole.message
    assert (message.model_extra.get("reasoning"), message.content, _calls(message.tool_calls)) == expected
    assert message.model_extra.get("reasoning_content") == expected[0]
    assert whole.finish_reason == ("tool_calls" if expected[2] else "stop")
    streamed = ("".join(c.delta.model_extra.get("reasoning") or "" for c in chunks) or None,
                "".join(c.delta.content or "" for c in chunks) or None,
                [{"name": p.function.name, "arguments": p.function.arguments} for c in chunks
                 for p in c.delta.tool_calls or []])
    assert streamed == expected
    assert chunks[-1].finish_reason == whole.finish_reason


async def test_the_prompt_is_k3s_with_reasoning_effort_and_keeps_the_xtml_markers(engine, tokenizer):
    engine.reply = tokenizer.encode("ok<|close|>think<|sep|><|open|>response<|sep|>hi<|close|>response<|sep|>")
    async with sdk(engine) as client:
        await client.chat.completions.create(model="k3-tiny", messages=ASK, tools=TOOLS, reasoning_effort="max")
        await client.chat.completions.create(model="k3-tiny", messages=ASK, reasoning_effort="none")
    with_effort, without_thinking = engine.requests
    assert with_effort.prompt == tokenizer.encode_chat(ASK, tools=TOOLS, thinking_effort="max")
    assert tokenizer.decode(with_effort.prompt).endswith("<|open|>think<|sep|>")
    assert tokenizer.decode(without_thinking.prompt).endswith("<|open|>response<|sep|>")
    kept = {tokenizer.special_token_id(t) for t in ("<|open|>", "<|close|>", "<|sep|>")}
    assert set(with_effort.sampling_params.keep_special_token_ids) == kept


async def test_a_forced_tool_choice_prompts_k3_without_thinking_and_reads_back_the_json(engine, tokenizer):
    engine.reply = tokenizer.encode('{"city": "Paris"}')
    async with sdk(engine) as client:
        out = await client.chat.completions.create(
            model="k3-tiny", messages=ASK, tools=TOOLS[:1], tool_choice={"type": "function",
                                                                         "function": {"name": "get_weather"}})
    (call,) = out.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert tokenizer.decode(engine.requests[0].prompt).endswith("<|open|>response<|sep|>")


async def test_a_structured_output_is_the_response_channel_as_constrained(engine, tokenizer):
    engine.reply = tokenizer.encode('{"ok": true}') + [tokenizer.special_token_id("<|end_of_msg|>")]
    async with sdk(engine) as client:
        out = await client.chat.completions.create(model="k3-tiny", messages=ASK,
                                                   response_format={"type": "json_object"})
    message = out.choices[0].message
    assert (message.content, message.model_extra.get("reasoning")) == ('{"ok": true}', None)
    prompt = tokenizer.decode(engine.requests[0].prompt)
    assert "`response_format=json_object`" in prompt and prompt.endswith("<|open|>response<|sep|>")


async def test_tool_choice_none_shows_the_tools_and_drops_any_call(engine, tokenizer):
    case = next(case for case in GOLDENS if case["name"] == "one_call")
    engine.reply = tokenizer.encode(case["text"]) + [tokenizer.special_token_id("<|end_of_msg|>")]
    async with sdk(engine) as client:
        out = await client.chat.completions.create(model="k3-tiny", messages=ASK, tools=TOOLS, tool_choice="none")
    choice = out.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("Checking.", None, "stop")
    prompt = tokenizer.decode(engine.requests[0].prompt)
    assert 'type="tool-declare"' in prompt and "You MUST NOT call any tools" in prompt


async def test_a_multi_turn_chat_with_calls_and_results_is_prompted_as_k3_renders_it(engine, tokenizer):
    calls = [{"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    messages = [*ASK, {"role": "assistant", "content": "Checking.", "reasoning": "Need weather.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"}]
    engine.reply = tokenizer.encode("done<|close|>think<|sep|><|open|>response<|sep|>Sunny.<|close|>response<|sep|>")
    async with sdk(engine) as client:
        out = await client.chat.completions.create(model="k3-tiny", messages=messages, tools=TOOLS)
    assert out.choices[0].message.content == "Sunny."
    assert engine.requests[0].prompt == tokenizer.encode_chat(messages, tools=TOOLS)
    assert ('<|open|>think<|sep|>Need weather.<|close|>think<|sep|><|open|>response<|sep|>Checking.'
            in tokenizer.decode(engine.requests[0].prompt))


@pytest.mark.parametrize("body, param", [
    ({"reasoning_effort": "medium"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"thinking_budget": 5}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs"),
    ({"reasoning_effort": "max", "response_format": {"type": "json_object"}}, "reasoning_effort"),
])
async def test_what_k3_cannot_honour_is_a_400_naming_the_field(engine, body, param):
    app = build_app(engine, IngressMetrics(CollectorRegistry(), model_name=engine.model_name))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as http:
        assert_error(await http.post(CHAT, json={"messages": ASK, **body}), 400, param=param)
    assert engine.requests == []


async def test_kimi_k2s_format_refuses_k3s_thinking_fields(tiny_checkpoint):
    engine = ScriptedEngine(Tokenizer.from_dir(tiny_checkpoint))
    app = build_app(engine, IngressMetrics(CollectorRegistry(), model_name=engine.model_name))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as http:
        assert_error(await http.post(CHAT, json={"messages": ASK, "reasoning_effort": "max"}), 400,
                     param="reasoning_effort")
        assert_error(await http.post(CHAT, json={"messages": ASK, "chat_template_kwargs": {"thinking": False}}), 400,
                     param="chat_template_kwargs")


async def test_without_auto_tool_choice_a_request_with_tools_is_a_400(engine):
    app = build_app(engine, IngressMetrics(CollectorRegistry(), model_name=engine.model_name),
                    enable_auto_tool_choice=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as http:
        assert_error(await http.post(CHAT, json={"messages": ASK, "tools": TOOLS}), 400, param="tool_choice")
        engine.reply = [engine.tokenizer.special_token_id("<|end_of_msg|>")]
        assert (await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "tool_choice": "none"})).status_code == 200


def test_the_parsers_follow_the_checkpoint_unless_named(tokenizer, tiny_checkpoint):
    assert (tokenizer.chat_format, Tokenizer.from_dir(tiny_checkpoint).chat_format) == ("kimi_k3", "kimi_k2")
    k3 = chat_parsers("kimi_k3")
    assert (k3.reasoning, k3.tool_calls, chat_parsers("kimi_k2", "kimi").reasoning) == ("kimi_k3", "kimi_k3", "kimi_k2")
    named = chat_parsers("kimi_k2", "kimi_k3", "kimi_k3")
    assert (named.reasoning, named.tool_calls) == ("kimi_k3", "kimi_k3")
    assert chat_parsers("kimi_k3", "none").tool_calls == "kimi_k3"
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, kimi_k2, kimi_k3"):
        chat_parsers("kimi_k2", tool_call_parser="hermes")
    with pytest.raises(ValueError, match="name the same format for both"):
        chat_parsers("kimi_k2", "kimi_k3")  # K3's reasoning parser with the checkpoint's kimi_k2 tool-call parser


def test_serve_configs_parser_choices_are_the_registrys():
    fields = ServeConfig.model_fields
    assert get_args(fields["reasoning_parser"].annotation) == REASONING_PARSER_CHOICES
    assert get_args(fields["tool_call_parser"].annotation) == TOOL_CALL_PARSER_CHOICES
