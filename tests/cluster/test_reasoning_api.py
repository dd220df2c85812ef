"""A thinking model's reasoning on /v1/chat/completions (`reasoning_content`), through the real app and tokenizer.

As in test_tool_calls_api.py, a scripted EngineClient answers every request with the same token ids (the think
markers are single special tokens), detokenized under the request's own sampling params, one token a delta."""

from __future__ import annotations

import pytest

from k3serve.cluster.api import build_app

from test_api import parse_sse
from test_tool_calls_api import ASK, EXPECTED_CALLS, TOOLS, TWO_CALLS, ScriptedEngine, ingress, streamed_calls
from test_tool_calls_api import tokenizer  # noqa: F401  (the module's tokenizer fixture)

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
THOUGHT = "The user wants the weather in Paris and the time there.\n"
ANSWER = "Sunny, 21 degrees."
THINKING = f"<think>{THOUGHT}</think>{ANSWER}<|im_end|>"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(tokenizer) -> ScriptedEngine:  # noqa: F811
    engine = ScriptedEngine(tokenizer)
    engine.reply = tokenizer.encode(THINKING)
    assert tokenizer.special_token_id("</think>") in engine.reply  # one token, not text
    return engine


def streamed(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key, "") for c in chunks if c["choices"])


async def test_the_reasoning_comes_back_apart_from_the_answer(engine, tokenizer):  # noqa: F811
    async with ingress(engine) as http:  # reasoning_parser "auto" (kimi_k2 for this vocabulary) is the default
        r = await http.post(CHAT, json={"messages": ASK})
    (choice,) = r.json()["choices"]
    assert choice["message"] == {"role": "assistant", "reasoning": THOUGHT, "reasoning_content": THOUGHT,
                                 "content": ANSWER}
    assert choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == len(engine.reply)  # the reasoning's tokens count too
    params, specials = engine.requests[0].sampling_params, tokenizer.special_tokens
    assert params.skip_special_tokens and {specials["<think>"], specials["</think>"]} <= set(
        params.keep_special_token_ids)  # the markers reach the parser; other special tokens are skipped as ever


async def test_the_stream_sends_reasoning_deltas_then_content_deltas(engine):
    async with ingress(engine) as http:
        r = await http.post(CHAT, json={"messages": ASK, "stream": True, "stream_options": {"include_usage": True}})
        whole = (await http.post(CHAT, json={"messages": ASK})).json()["choices"][0]["message"]
    *chunks, usage = parse_sse(r.text)
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert streamed(chunks, "reasoning_content") == THOUGHT and streamed(chunks, "content") == ANSWER
    assert streamed(chunks, "reasoning") == THOUGHT  # vLLM's name; reasoning_content its older one
    assert sum("reasoning_content" in d for d in deltas) > 5  # the reasoning arrives as it is generated
    last_reasoning = max(i for i, d in enumerate(deltas) if "reasoning_content" in d)
    assert all("content" not in d for d in deltas[: last_reasoning + 1])  # no null keys, answer after the thought
    assert not any("think>" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage["usage"]["completion_tokens"] == len(engine.reply)
    assert whole == {"role": "assistant", "reasoning": THOUGHT, "reasoning_content": THOUGHT, "content": ANSWER}


async def test_reasoning_then_tool_calls(engine, tokenizer):  # noqa: F811
    engine.reply = tokenizer.encode(f"<think>{THOUGHT}</think>{TWO_CALLS}")
    async with ingress(engine) as http:
        whole = (await http.post(CHAT, json={"messages": ASK, "tools": TOOLS})).json()["choices"][0]
        chunks = parse_sse((await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "stream": True})).text)
    assert whole["message"] == {"role": "assistant", "reasoning": THOUGHT, "reasoning_content": THOUGHT,
                                "content": "Let me check.", "tool_calls": EXPECTED_CALLS}
    assert whole["finish_reason"] == "tool_calls"
    assert streamed(chunks, "reasoning_content") == THOUGHT and streamed(chunks, "content") == "Let me check."
    assert streamed_calls(chunks) == EXPECTED_CALLS
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_block_the_prompt_opened_is_reasoning_up_to_its_end(engine, tokenizer):  # noqa: F811
    """A prompt ending in <think> (here an assistant turn continued; a thinking template's generation prompt)."""
    messages = [*ASK, {"role": "assistant", "content": "<think>"}]
    engine.reply = tokenizer.encode(f"{THOUGHT}</think>{ANSWER}<|im_end|>")
    async with ingress(engine) as http:
        r = await http.post(CHAT, json={"messages": messages, "add_generation_prompt": False})
        chunks = parse_sse((await http.post(CHAT, json={"messages": messages, "add_generation_prompt": False,
                                                        "stream": True})).text)
    assert engine.requests[0].prompt[-1] == tokenizer.special_token_id("<think>")
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "reasoning": THOUGHT,
                                                 "reasoning_content": THOUGHT, "content": ANSWER}
    assert (streamed(chunks, "reasoning_content"), streamed(chunks, "content")) == (THOUGHT, ANSWER)


async def test_a_turn_cut_while_thinking_is_all_reasoning(engine, tokenizer):  # noqa: F811
    cut = engine.reply.index(tokenizer.special_token_id("</think>"))
    async with ingress(engine) as http:
        r = await http.post(CHAT, json={"messages": ASK, "max_tokens": cut})
    (choice,) = r.json()["choices"]
    assert choice["message"] == {"role": "assistant", "reasoning": THOUGHT, "reasoning_content": THOUGHT,
                                 "content": None}
    assert choice["finish_reason"] == "length"


async def test_a_model_that_does_not_think_is_served_as_before(engine, tokenizer):  # noqa: F811
    engine.reply = tokenizer.encode(f"{ANSWER}<|im_end|>")
    async with ingress(engine) as http:
        whole = (await http.post(CHAT, json={"messages": ASK})).json()["choices"][0]["message"]
        chunks = parse_sse((await http.post(CHAT, json={"messages": ASK, "stream": True})).text)
    assert whole == {"role": "assistant", "content": ANSWER}
    assert streamed(chunks, "content") == ANSWER
    assert not any("reasoning_content" in c["choices"][0]["delta"] for c in chunks)


async def test_reasoning_parser_none_returns_the_text_as_generated(engine, tokenizer):  # noqa: F811
    async with ingress(engine, reasoning_parser="none") as http:
        whole = (await http.post(CHAT, json={"messages": ASK})).json()["choices"][0]["message"]
        chunks = parse_sse((await http.post(CHAT, json={"messages": ASK, "stream": True})).text)
        await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "tool_choice": "none"})
    assert whole == {"role": "assistant", "content": THOUGHT + ANSWER}  # the markers skipped as special tokens
    assert streamed(chunks, "content") == THOUGHT + ANSWER
    assert [r.sampling_params.skip_special_tokens for r in engine.requests] == [True, True, True]


async def test_completions_are_untouched(engine, tokenizer):  # noqa: F811
    async with ingress(engine) as http:
        r = await http.post("/v1/completions", json={"prompt": "Weather?", "max_tokens": 64,
                                                     "skip_special_tokens": False})
    assert r.json()["choices"][0]["text"] == THINKING


def test_an_unknown_parser_is_refused(engine):
    with pytest.raises(ValueError, match="reasoning_parser must be one of auto, kimi, kimi_k2, kimi_k3, none"):
        build_app(engine, reasoning_parser="deepseek_r1")
