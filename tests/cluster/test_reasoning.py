"""A Kimi thinking model's <think> block -> reasoning and content (cluster/api/reasoning.py), on text in the model's
exact format: whole, and streamed in pieces cut anywhere (inside a marker too), against splits written out by hand;
then chained into the tool-call parser as the chat formatter chains them."""

from __future__ import annotations

import random

import pytest

from k3serve.cluster.api.reasoning import ReasoningStream, prompt_opens_reasoning
from k3serve.cluster.api.tool_calls import ParsedCall, ToolCallStream
from k3serve.model.chat_template import KIMI_SPECIAL_TOKENS

SPECIALS = list(KIMI_SPECIAL_TOKENS)
THOUGHT = "The user greets me <b>warmly</b>; a short answer will do.\n"
ANSWER = "Hello! How can I help?"
THINKING = f"<think>{THOUGHT}</think>{ANSWER}<|im_end|>"
CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')


def split(text: str, cuts: list[int] = (), **options) -> tuple[str, str]:
    """(reasoning, content) of `text` fed in the pieces between `cuts`, then finished."""
    stream = ReasoningStream(SPECIALS, **options)
    bounds = [0, *sorted(cuts), len(text)]
    deltas = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [stream.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content_text for d in deltas)


T, A = "I think <b>x</b>.\n", "Hi!"  # short: every text below is cut at each of its positions
SPLITS = {  # id: (text, options, expected reasoning, expected content), written out by hand
    "think-then-answer": (f"<think>{T}</think>{A}<|im_end|>", {}, T, A),
    "stop-token-kept-for-the-tool-parser": (f"<think>{T}</think>{A}<|im_end|>", {"keep_special": True}, T,
                                            A + "<|im_end|>"),
    "no-marker-all-content": ("<think </think <|x|> <<|im_end|>", {}, "", "<think </think <|x|> <"),
    "opened-by-the-prompt": (f"{T}</think>{A}", {"in_reasoning": True}, T, A),
    "never-closed-cut-by-max-tokens": (f"<think>{T}", {}, T, ""),
    "opened-by-the-prompt-never-closed": (T, {"in_reasoning": True}, T, ""),
    "stray-end-dropped": (f"{A}</think>{A}", {}, "", A + A),
    "two-blocks": ("<think>a</think>b<think>c</think>d", {}, "ac", "bd"),
    "other-token-dropped-from-reasoning": (f"<think>{T}<|im_middle|></think>{A}", {"keep_special": True}, T, A),
    "held-back-start-in-reasoning-is-text": (f"<think>{T}</thi", {}, T + "</thi", ""),
    "held-back-start-in-content-is-text": (f"{A} <|im_", {}, "", A + " <|im_"),
    "calls-end-an-open-block": (f"<think>{T}{CALL}<|im_end|>", {"keep_special": True}, T, CALL + "<|im_end|>"),
    "calls-markers-dropped": (f"<think>{T}{CALL}", {}, T, 'functions.get_weather:0{"city": "Paris"}'),
    "calls-end-a-block-the-prompt-opened": (f"{T}{CALL}", {"in_reasoning": True, "keep_special": True}, T, CALL),
}


@pytest.mark.parametrize("text, options, reasoning, content", SPLITS.values(), ids=SPLITS.keys())
def test_the_split_is_the_same_however_the_text_is_cut(text, options, reasoning, content):
    """Whole, cut once at every position (inside every marker too), and a character at a time."""
    for cuts in [[], *([cut] for cut in range(1, len(text))), list(range(1, len(text)))]:
        assert split(text, cuts, **options) == (reasoning, content), cuts


@pytest.mark.parametrize("seed", range(5))
def test_any_split_of_a_long_text_gives_the_expected_split(seed):
    rng = random.Random(seed)
    text = THINKING + CALL
    cuts = rng.sample(range(1, len(text)), rng.randint(1, 30))
    assert split(text, cuts) == (THOUGHT, ANSWER + 'functions.get_weather:0{"city": "Paris"}')
    assert split(text, cuts, keep_special=True) == (THOUGHT, ANSWER + "<|im_end|>" + CALL)


def test_one_character_at_a_time_never_leaks_a_marker():
    stream = ReasoningStream(SPECIALS)
    deltas = [stream.feed(c) for c in THINKING] + [stream.finish()]
    assert all("<" not in d.content_text and "think>" not in d.reasoning for d in deltas)
    assert ("".join(d.reasoning for d in deltas), "".join(d.content_text for d in deltas)) == (THOUGHT, ANSWER)
    assert sum(bool(d.reasoning) for d in deltas) > 10  # the reasoning streams as it is generated


def chained(text: str, cuts: list[int]) -> tuple[str, str, list[ParsedCall]]:
    """`text` fed in the pieces between `cuts` to the reasoning parser, its content handed on lexed to the tool-call
    parser (as the chat formatter chains them): (reasoning, content, calls)."""
    reasoning_stream, tool_stream = ReasoningStream(SPECIALS, keep_special=True), ToolCallStream()
    bounds, reasoning = [0, *cuts, len(text)], ""
    for a, b in zip(bounds, bounds[1:]):
        delta = reasoning_stream.feed(text[a:b])
        reasoning += delta.reasoning
        tool_stream.read(delta.content)
    end = reasoning_stream.finish()
    tool_stream.finish(end.held_back)
    return reasoning + end.reasoning, *tool_stream.result()


WEATHER_CALL = ParsedCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}')
CHAINS = {  # id: (text, expected reasoning, content, calls)
    "reasoning-content-call": (f"<think>{T}</think>Let me check.{CALL}<|im_end|>", T, "Let me check.", [WEATHER_CALL]),
    "calls-end-a-block-left-open": (f"<think>{T}Let me check.{CALL}<|im_end|>", T + "Let me check.", "",
                                    [WEATHER_CALL]),
    "a-start-of-a-marker-held-to-the-end": (f"<think>{T}</think>{A} <|tool_c", T, A + " <|tool_c", []),
}


@pytest.mark.parametrize("text, reasoning, content, calls", CHAINS.values(), ids=CHAINS.keys())
def test_reasoning_then_tool_calls_however_the_text_is_cut(text, reasoning, content, calls):
    for cuts in [[], *([cut] for cut in range(1, len(text)))]:
        assert chained(text, cuts) == (reasoning, content, calls), cuts


IDS = KIMI_SPECIAL_TOKENS


@pytest.mark.parametrize("prompt, opened", [
    ([1, 2, IDS["<|im_middle|>"], IDS["<think>"]], True),  # a template that starts the reasoning
    ([1, IDS["<think>"], 2, 3], True),
    ([1, 2, IDS["<|im_middle|>"]], False),
    ([IDS["<think>"], 2, IDS["</think>"], 3], False),  # a closed block
    ([IDS["<think>"], 2, IDS["<|im_end|>"], IDS["<|im_assistant|>"], 3], False),  # an earlier turn's open block
    ([], False),
])
def test_the_prompt_decides_whether_the_answer_starts_in_reasoning(prompt, opened):
    assert prompt_opens_reasoning(prompt, KIMI_SPECIAL_TOKENS) is opened
