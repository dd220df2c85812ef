"""Kimi's tool calls in generated text -> OpenAI tool calls (what vLLM serves with `--tool-call-parser kimi_k2`).

Kimi writes its calls after any content, each call's id and JSON arguments between special tokens:

    Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(one line in reality). The id is kept as the call's id, as vLLM does (the chat template renders it back in the next
turn); the function's name is what lies between "functions." and ":". The parser reads text, so the request keeps
these five markers as text (`SamplingParams.keep_special_token_ids`; other special tokens are skipped as ever); any
other special token the text holds (a client that asked for `skip_special_tokens: false`) is dropped, and none
reaches the content.

`ToolCallStream` reads the text in pieces as it is generated, already lexed (special_tokens.py: by the reasoning
parser when there is one, else by the chat formatter's reader): content as soon as it cannot be the start of a
marker, a call's id and name once its header is complete, then its arguments piece by piece; once finished, its
`result` is what it sent, put together: what a response that does not stream returns, so the two modes always agree.
`parse_tool_calls` reads a whole text.

Malformed output (a stray or misplaced marker, a header that is not `name:index`, a call still open at the end)
never raises: from where it breaks on, the text is content, markers and all, and nothing is lost. A stream cannot
take back what it sent before, so what was sent as calls stays calls, in both modes: the calls completed before a
malformed one (vLLM's kimi_k2 parser keeps them too, whole or streamed, but drops the malformed text), and a call
whose header was sent when the turn broke off inside it (its arguments so far, as OpenAI returns a call cut by
max_tokens). Broken before any call was sent, a text is all content. Only a call completed with
<|tool_call_end|> makes the turn's finish_reason "tool_calls" (formatting.py).

With `max_calls` (parallel_tool_calls false: 1) the calls past it are read but neither sent nor returned, as vLLM
filters them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Collection, Sequence

from .special_tokens import (
    ARGUMENTS_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    TOOL_MARKERS as MARKERS,
    Piece,
    lexer_for,
)

_CALL_ID = re.compile(r"(?:functions\.)?(?P<name>[^\s:]+):\d+")


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass
class ToolCallDelta:
    """A piece of call `index`: its id and name on the call's first piece, then argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)  # at most one piece per call, in call order

    def add_arguments(self, index: int, text: str) -> None:
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += text
        else:
            self.calls.append(ToolCallDelta(index, text))


class ToolCallStream:
    """One choice's text, read as lexed pieces (`read`, then `finish` once), split into content and tool-call
    pieces; then `result`. A special token that is not a marker is dropped (the stop token, or any other a client
    asked for with `skip_special_tokens: false`)."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # calls past it are dropped (None: no limit)
        self._state = "content"  # content | section | header | arguments | broken
        self._unsent = ""  # read but not sent: markers and header of the call being read (content if it breaks)
        self._header = ""
        self._blank = ""  # whitespace at the end of the arguments so far: sent once more arguments follow
        self._arguments_begun = False  # the current call has sent argument text
        self.num_calls = 0  # calls whose header was sent
        self.num_complete = 0  # calls whose <|tool_call_end|> was read
        self.malformed = False
        self._content: list[str] = []  # all sent as content
        self._calls: list[tuple[str, str, list[str]]] = []  # all sent as calls: (id, name, argument pieces)

    def read(self, pieces: Sequence[Piece]) -> ParsedDelta:
        out = ParsedDelta()
        if not pieces:  # most deltas of a reasoning: nothing for this parser
            return out
        for piece, is_token in pieces:
            if is_token and piece not in MARKERS:
                self._read_dropped(out)
                continue
            (self._read_token if is_token else self._read_text)(piece, out)
        return self._kept(out)

    def finish(self, held_back: str = "") -> ParsedDelta:
        """The end of the text: what the lexer held back (which never became a special token) and what was not sent
        go out as content; a call or a section left open with nothing in it is malformed."""
        out = ParsedDelta()
        rest = self._unsent + self._blank + held_back
        if self._state in ("header", "arguments") or (self._state == "section" and self.num_complete == 0):
            self.malformed = True
        if self.malformed or self._state in ("content", "broken") or rest.strip():
            out.content += rest
        self._state = "broken"
        return self._kept(out)

    def result(self) -> tuple[str, list[ParsedCall]]:
        """The whole text, once finished: (its content, its tool calls), as they were sent."""
        return "".join(self._content), [ParsedCall(i, name, "".join(parts)) for i, name, parts in self._calls]

    def _kept(self, out: ParsedDelta) -> ParsedDelta:
        """`out` less the calls past `max_calls`, kept for `result` too."""
        if self.max_calls is not None:
            out.calls = [piece for piece in out.calls if piece.index < self.max_calls]
        self._content.append(out.content)
        for piece in out.calls:
            if piece.id is not None:
                self._calls.append((piece.id, piece.name, []))
            self._calls[piece.index][2].append(piece.arguments)
        return out

    def _read_text(self, text: str, out: ParsedDelta) -> None:
        if not text:
            return
        if self._state in ("content", "broken"):
            out.content += text
        elif self._state == "section":
            if text.strip():
                self._break(text, out)
            else:
                self._unsent += text
        elif self._state == "header":
            self._unsent += text
            self._header += text
        else:
            self._read_arguments(text, out)

    def _read_arguments(self, text: str, out: ParsedDelta) -> None:
        """Arguments as they come, without the whitespace that pads them (vLLM strips it)."""
        text = self._blank + text if self._arguments_begun else text.lstrip()
        body = text.rstrip()
        self._blank = text[len(body):]
        if body:
            self._arguments_begun = True
            out.add_arguments(self.num_calls - 1, body)

    def _read_dropped(self, out: ParsedDelta) -> None:
        if self._state in ("header", "arguments"):
            self._break("", out)  # the turn ended inside a call

    def _read_token(self, token: str, out: ParsedDelta) -> None:
        state = self._state
        if state == "broken":
            out.content += token
        elif state == "content" and token == SECTION_BEGIN:
            self._state, self._unsent = "section", token
        elif state == "section" and token == SECTION_END:
            self._state, self._unsent = "content", ""
        elif state == "section" and token == CALL_BEGIN:
            self._state, self._header = "header", ""
            self._unsent += token
        elif state == "header" and token == ARGUMENTS_BEGIN and (call := _CALL_ID.fullmatch(self._header.strip())):
            out.calls.append(ToolCallDelta(self.num_calls, "", self._header.strip(), call.group("name")))
            self.num_calls += 1
            self._state, self._unsent, self._arguments_begun = "arguments", "", False
        elif state == "arguments" and token == CALL_END:
            self.num_complete += 1
            self._state, self._blank = "section", ""
        else:
            self._break(token, out)

    def _break(self, text: str, out: ParsedDelta) -> None:
        """Malformed: what was read of the broken call and everything after it is content."""
        self.malformed = True
        out.content += self._unsent + self._blank + text
        self._state, self._unsent, self._blank = "broken", "", ""


def parse_tool_calls(text: str, special_tokens: Collection[str]) -> tuple[str, list[ParsedCall]]:
    """A whole text -> (its content, its tool calls), as a stream of it sends them."""
    pieces, held_back = lexer_for(special_tokens).split(text)
    stream = ToolCallStream()
    stream.read(pieces)
    stream.finish(held_back)
    return stream.result()
