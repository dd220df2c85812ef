"""Kimi's tool-call format -> OpenAI tool calls (cluster/api/tool_calls.py), on text in the model's exact format:
a whole text, and the same text streamed in pieces cut anywhere (inside a marker, inside the JSON), lexed as the
chat formatter lexes it (special_tokens.py)."""

from __future__ import annotations

import random

import pytest

from k3serve.cluster.api.special_tokens import SpecialTokenReader
from k3serve.cluster.api.tool_calls import ParsedCall, ParsedDelta, ToolCallStream, parse_tool_calls
from k3serve.model.chat_template import KIMI_SPECIAL_TOKENS

SPECIALS = list(KIMI_SPECIAL_TOKENS)


def call(call_id: str, arguments: str) -> str:
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"


def section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"zone": "Europe/Paris"}'
TWO_CALLS = "I will look both up." + section(call("functions.get_weather:0", WEATHER),
                                             call("functions.get_time:1", TIME)) + "<|im_end|>"


class Parser:
    """A ToolCallStream fed text, as the chat formatter feeds it: through a reader of the vocabulary."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.reader, self.stream = SpecialTokenReader(SPECIALS), ToolCallStream(max_calls)

    def feed(self, text: str) -> ParsedDelta:
        return self.stream.read(self.reader.feed(text))

    def finish(self) -> ParsedDelta:
        return self.stream.finish(self.reader.finish())


def streamed(text: str, cuts: list[int], max_calls: int | None = None
             ) -> tuple[str, list[ParsedCall], list[ParsedDelta], ToolCallStream]:
    """`text` fed in the pieces between `cuts`, then finished: the content, the calls the pieces assemble, the
    pieces themselves and the stream."""
    parser = Parser(max_calls)
    bounds = [0, *sorted(cuts), len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    content, calls = "", []
    for delta in deltas:
        content += delta.content
        for piece in delta.calls:
            if piece.id is not None:
                assert piece.index == len(calls) and piece.name, piece  # a call starts with its id and name
                calls.append(ParsedCall(piece.id, piece.name, ""))
            else:
                assert piece.name is None and piece.arguments, piece  # then only argument text
            calls[piece.index].arguments += piece.arguments
    return content, calls, deltas, parser.stream


def test_one_call_without_content():
    content, calls = parse_tool_calls(section(call("functions.get_weather:0", WEATHER)), SPECIALS)
    assert content == ""
    assert calls == [ParsedCall("functions.get_weather:0", "get_weather", WEATHER)]


def test_two_calls_after_content_the_stop_token_dropped():
    content, calls = parse_tool_calls(TWO_CALLS, SPECIALS)
    assert content == "I will look both up."
    assert calls == [ParsedCall("functions.get_weather:0", "get_weather", WEATHER),
                     ParsedCall("functions.get_time:1", "get_time", TIME)]


def test_padding_whitespace_is_not_part_of_the_call():
    text = ("<|tool_calls_section_begin|>\n<|tool_call_begin|> functions.f:0 <|tool_call_argument_begin|>\n"
            '{"a": 1}\n<|tool_call_end|>\n<|tool_call_begin|>g:1<|tool_call_argument_begin|>{}<|tool_call_end|>\n'
            "<|tool_calls_section_end|>")
    assert parse_tool_calls(text, SPECIALS) == ("", [ParsedCall("functions.f:0", "f", '{"a": 1}'),
                                                     ParsedCall("g:1", "g", "{}")])


def test_text_without_a_call_is_the_content_less_the_stop_token():
    text = "Plain <answer> with a <| lookalike, x <|y|> and \u00e9t\u00e9."
    assert parse_tool_calls(text + "<|im_end|>", SPECIALS) == (text, [])
    assert streamed(text + "<|im_end|>", list(range(1, len(text))))[0] == text


@pytest.mark.parametrize("seed", range(20))
def test_any_split_streams_what_the_whole_text_parses_to(seed):
    rng = random.Random(seed)
    cuts = rng.sample(range(1, len(TWO_CALLS)), rng.randint(1, 40))
    content, calls, deltas, stream = streamed(TWO_CALLS, cuts)
    assert (content, calls) == parse_tool_calls(TWO_CALLS, SPECIALS) == stream.result()
    assert not stream.malformed and stream.num_complete == 2


def test_one_character_at_a_time_never_leaks_a_marker():
    content, calls, deltas, _ = streamed(TWO_CALLS, list(range(1, len(TWO_CALLS))))
    assert all("<|" not in d.content for d in deltas)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    pieces = [p.arguments for d in deltas for p in d.calls if p.index == 0 and p.id is None]
    assert len(pieces) > 10 and "".join(pieces) == WEATHER  # the arguments arrive as they are generated


def test_a_cut_inside_a_marker_holds_back_only_that_marker():
    stream = Parser()
    assert stream.feed("Sure<|tool_calls_sec").content == "Sure"
    delta = stream.feed('tion_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"q": "<|')
    assert delta.content == "" and len(delta.calls) == 1
    assert (delta.calls[0].id, delta.calls[0].name, delta.calls[0].arguments) == ("functions.f:0", "f", '{"q": "')
    assert stream.feed('x"}<|tool_call_end|>').calls[0].arguments == '<|x"}'  # "<|x" was no marker after all


def test_the_last_piece_of_content_comes_out_at_the_finish():
    stream = Parser()
    assert stream.feed("a <|im_").content == "a "
    assert stream.finish().content == "<|im_"


MALFORMED = [
    "Hi" + "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0",
    "Hi" + "<|tool_calls_section_begin|>",
    "Hi" + section(call("not a call id", "{}")),
    "Hi" + section(call("functions.f", "{}")),
    "Hi" + section("stray text" + call("functions.f:0", "{}")),
    "Hi" + call("functions.f:0", "{}"),  # a call outside a section
    "Hi" + section("<|tool_call_begin|>functions.f:0<|tool_call_end|>"),  # no arguments marker
]


def every_split(text: str) -> list[list[int]]:
    """Each single cut, and a cut between every two characters."""
    return [[cut] for cut in range(1, len(text))] + [list(range(1, len(text)))]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_output_is_returned_as_content(text):
    """Broken before any call was sent: streamed, cut anywhere, it is all content, and the very content the whole
    response returns."""
    assert parse_tool_calls(text + "<|im_end|>", SPECIALS) == (text, [])
    for cuts in every_split(text + "<|im_end|>"):
        content, calls, _, stream = streamed(text + "<|im_end|>", cuts)
        assert (content, calls) == (text, []) and stream.malformed, cuts
        assert stream.result() == (text, [])


def test_a_call_cut_inside_its_arguments_stays_the_call_so_far():
    """The call's id, name and arguments were streamed before the turn ended inside it: the stream cannot take them
    back, so the call so far is a call in the whole text's result too (as OpenAI returns a call cut by max_tokens),
    not a complete one."""
    text = "Hi<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1"
    expected = ("Hi", [ParsedCall("functions.f:0", "f", '{"a": 1')])
    assert parse_tool_calls(text + "<|im_end|>", SPECIALS) == expected
    for cuts in every_split(text + "<|im_end|>"):
        content, calls, _, stream = streamed(text + "<|im_end|>", cuts)
        assert (content, calls) == stream.result() == expected and stream.malformed, cuts
        assert stream.num_complete == 0


@pytest.mark.parametrize("bad", [
    "<|tool_call_begin|>bad header<|tool_call_argument_begin|>{}<|tool_call_end|>",  # not `name:index`
    "<|tool_call_begin|>functions.g:1<|tool_call_end|>",  # no arguments marker
    "stray text",
])
def test_a_text_breaking_after_a_good_call_keeps_it_and_the_rest_is_content(bad):
    """The good call was sent whole before the break: it stays a call in both modes (as vLLM keeps it); from the
    break on, the text is content (vLLM drops it)."""
    text = "Hi" + "<|tool_calls_section_begin|>" + call("functions.f:0", "{}") + bad + "<|tool_calls_section_end|>"
    expected = ("Hi" + bad + "<|tool_calls_section_end|>", [ParsedCall("functions.f:0", "f", "{}")])
    assert parse_tool_calls(text + "<|im_end|>", SPECIALS) == expected
    for cuts in every_split(text + "<|im_end|>"):
        content, calls, _, stream = streamed(text + "<|im_end|>", cuts)
        assert (content, calls) == stream.result() == expected and stream.malformed, cuts
        assert stream.num_complete == 1


def test_at_most_max_calls_are_sent_and_returned():
    """parallel_tool_calls false: the first call only; the second is read, and neither sent nor returned."""
    expected = ("I will look both up.", [ParsedCall("functions.get_weather:0", "get_weather", WEATHER)])
    for cuts in every_split(TWO_CALLS):
        content, calls, _, stream = streamed(TWO_CALLS, cuts, max_calls=1)
        assert (content, calls) == stream.result() == expected and stream.num_complete == 2, cuts


def test_an_empty_section_is_no_call():
    assert parse_tool_calls("Nothing to call." + section(), SPECIALS) == ("Nothing to call.", [])
