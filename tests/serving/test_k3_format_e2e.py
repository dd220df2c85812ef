"""Kimi K3's chat format end to end, with the `openai` client, on real `k3serve serve` processes serving the
k3-tiny-xtml checkpoint (k3-tiny with K3's tokenizer): colocated, and disaggregated (1P1D, Mooncake, the local
launcher: the prefill engine samples the first token, the decode engine the rest).

Spec:
- The server picks the kimi_k3 parsers from the checkpoint's tokenizer by itself.
- A chat with tools and `reasoning_effort` "max" (thinking) or "none" (no thinking) is prompted in K3's format
  (usage.prompt_tokens is the K3 encoder's count, thinking-effort note included; the think or the response channel
  open).
- Its answer is the generated text as the K3 parsers read it (parse_xtml, which tests/cluster/test_k3_parser_goldens.py
  holds to vLLM's kimi_k3 parsers): the same greedy output, asked for as raw text on /v1/completions with the
  special tokens kept, parses to the chat's `reasoning`, `content` and `tool_calls`, streamed and whole. The random
  model is pushed onto XTML's markers and channel names with logit_bias, so the text is made of them (it never
  closes the channel the prompt opened: with thinking all of it is reasoning, without all content; the goldens,
  through the app, cover the rest: tests/cluster/test_k3_format_api.py).
- A forced tool choice ("required") is prompted without thinking, with K3's tool-choice note, and its constrained
  output comes back as the call.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3serve.cluster.api.xtml import parse_xtml
from k3serve.model.checkpoint import make_checkpoint
from k3serve.model.tokenizer import Tokenizer

from _server_harness import Server, ServerSpec, serve
from test_openai_e2e import client_of

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
MAX_TOKENS = 40
SPECS = [ServerSpec(mode="colocated", launcher="local"), ServerSpec(launcher="local")]


@pytest.fixture(scope="module")
def k3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("k3-tiny-xtml", tmp_path_factory.mktemp("k3-tiny-xtml"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(k3_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(k3_checkpoint)


@pytest.fixture(scope="module", params=SPECS, ids=lambda spec: spec.id)
def k3_server(request: pytest.FixtureRequest, k3_checkpoint: Path, artifacts_dir: Path):
    yield from serve(request.param, k3_checkpoint, artifacts_dir, "k3-format")


def _xtml_bias(tokenizer: Tokenizer) -> dict[str, float]:
    """+100 on the markers and on the tokens of XTML's words: greedy decoding writes only those."""
    words = "think response tools call argument tool key type string index get_weather Paris".split()
    ids = {tokenizer.special_token_id(t) for t in ("<|open|>", "<|close|>", "<|sep|>")}
    ids |= {i for word in words for i in tokenizer.encode(word) + tokenizer.encode(" " + word)}
    return {str(i): 100.0 for i in sorted(ids)}


@pytest.mark.parametrize("effort, thinking", [("max", True), ("none", False)])
def test_a_chat_with_tools_and_reasoning_effort_returns_what_the_k3_parsers_read(
        k3_server: Server, tokenizer: Tokenizer, effort: str, thinking: bool) -> None:
    greedy = dict(model=k3_server.model, max_tokens=MAX_TOKENS, temperature=0.0, logit_bias=_xtml_bias(tokenizer))
    with client_of(k3_server) as client:
        chat = dict(messages=MESSAGES, tools=TOOLS, reasoning_effort=effort, **greedy)
        whole = client.chat.completions.create(**chat)
        chunks = [c.choices[0] for c in client.chat.completions.create(**chat, stream=True) if c.choices]
        prompt = tokenizer.encode_chat(MESSAGES, tools=TOOLS, thinking=thinking,
                                       thinking_effort=effort if thinking else None)
        raw = client.completions.create(prompt=prompt, extra_body={"skip_special_tokens": False}, **greedy)
    assert whole.usage.prompt_tokens == len(prompt)
    channel = "think" if thinking else "response"
    assert tokenizer.decode(prompt).endswith(f'<|open|>message role="assistant"<|sep|><|open|>{channel}<|sep|>')
    text = raw.choices[0].text
    assert any(marker in text for marker in ("<|open|>", "<|close|>", "<|sep|>")), text
    reasoning, content, calls = parse_xtml(text, thinking=thinking, tools=True)
    assert bool(reasoning) == thinking and bool(content) != thinking  # all one channel: the model never closes it
    message = whole.choices[0].message
    expected = (reasoning or None, content or None, [(c.name, c.arguments) for c in calls])
    assert (message.model_extra.get("reasoning"), message.content,
            [(c.function.name, c.function.arguments) for c in message.tool_calls or []]) == expected
    streamed = ("".join(c.delta.model_extra.get("reasoning") or "" for c in chunks) or None,
                "".join(c.delta.content or "" for c in chunks) or None,
                [(p.function.name, p.function.arguments) for c in chunks for p in c.delta.tool_calls or []])
    assert streamed == expected


def test_a_required_tool_choice_is_prompted_without_thinking_and_answers_calls(k3_server: Server,
                                                                             tokenizer: Tokenizer) -> None:
    light = {"type": "object", "properties": {"on": {"type": "boolean"}, "room": {"enum": ["kitchen", "hall"]}},
             "required": ["on", "room"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "set_light", "parameters": light}}]
    with client_of(k3_server) as client:
        out = client.chat.completions.create(model=k3_server.model, messages=MESSAGES, tools=tools,
                                             tool_choice="required", parallel_tool_calls=False, seed=3)
    prompt = tokenizer.encode_chat(MESSAGES, tools=tools, thinking=False, tool_choice="required")
    assert out.usage.prompt_tokens == len(prompt)
    (choice,) = out.choices
    assert choice.message.tool_calls, choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "set_light" and set(json.loads(call.function.arguments)) == {"on", "room"}
    assert (choice.finish_reason, choice.message.model_extra.get("reasoning")) == ("tool_calls", None)
