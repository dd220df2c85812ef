"""A Kimi thinking model's <think> block -> reasoning and content (cluster/api/reasoning.py), on text in the model's
exact format: whole, and streamed in pieces cut anywhere (inside a marker too); then chained into the tool-call
parser as the chat formatter does."""

from __future__ import annotations

import random

import pytest

from k3serve.cluster.api.reasoning import ReasoningStream, prompt_opens_reasoning
from k3serve.cluster.api.tool_calls import ParsedCall, parse_tool_calls
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
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


def test_reasoning_then_the_answer():
    assert split(THINKING) == (THOUGHT, ANSWER)


def test_text_without_markers_is_all_content():
    text = "Plain <thinking> about <think without a close, and a </think lookalike."
    assert split(text + "<|im_end|>") == ("", text)


def test_a_block_the_prompt_opened_makes_all_before_its_end_reasoning():
    assert split(f"{THOUGHT}</think>{ANSWER}<|im_end|>", in_reasoning=True) == (THOUGHT, ANSWER)


def test_a_stray_end_marker_is_dropped():
    assert split(f"{THOUGHT}</think>{ANSWER}") == ("", THOUGHT + ANSWER)


def test_no_end_marker_by_the_end_is_all_reasoning():
    """A turn cut by max_tokens while thinking: no content at all."""
    assert split(f"<think>{THOUGHT}") == (THOUGHT, "")
    assert split(THOUGHT, in_reasoning=True) == (THOUGHT, "")


def test_a_held_back_marker_start_that_never_completes_is_text():
    assert split(f"<think>{THOUGHT}</thi") == (THOUGHT + "</thi", "")
    assert split(f"{ANSWER} <|im_") == ("", ANSWER + " <|im_")


@pytest.mark.parametrize("seed", range(20))
def test_any_split_gives_what_the_whole_text_gives(seed):
    rng = random.Random(seed)
    text = THINKING + CALL
    cuts = rng.sample(range(1, len(text)), rng.randint(1, 30))
    for options in ({}, {"keep_special": True}):
        assert split(text, cuts, **options) == split(text, **options)


def test_one_character_at_a_time_never_leaks_a_marker():
    stream = ReasoningStream(SPECIALS)
    deltas = [stream.feed(c) for c in THINKING] + [stream.finish()]
    assert all("<" not in d.content and "think>" not in d.reasoning for d in deltas)
    assert ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)) == (THOUGHT, ANSWER)
    assert sum(bool(d.reasoning) for d in deltas) > 10  # the reasoning streams as it is generated


def test_other_special_tokens_stay_in_the_content_only_when_kept():
    text = f"<think>{THOUGHT}<|im_middle|></think>{ANSWER}<|im_end|>"
    assert split(text) == (THOUGHT, ANSWER)
    assert split(text, keep_special=True) == (THOUGHT, ANSWER + "<|im_end|>")  # for the tool-call parser next


def test_reasoning_then_a_tool_call_section():
    """The content, markers kept, goes on to the tool-call parser: reasoning, content and the call come apart."""
    reasoning, content = split(f"<think>{THOUGHT}</think>Let me check.{CALL}<|im_end|>", keep_special=True)
    assert reasoning == THOUGHT
    assert parse_tool_calls(content, SPECIALS) == (
        "Let me check.", [ParsedCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}')])


def test_tool_calls_end_a_block_left_open():
    """Kimi may call a tool without closing its reasoning: the section marker ends it."""
    reasoning, content = split(f"<think>{THOUGHT}{CALL}<|im_end|>", keep_special=True)
    assert reasoning == THOUGHT
    assert parse_tool_calls(content, SPECIALS)[1][0].name == "get_weather"


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
