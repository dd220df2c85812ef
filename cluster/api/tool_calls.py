"""Kimi's tool calls in generated text -> OpenAI tool calls (what vLLM serves with `--tool-call-parser kimi_k2`).

Kimi writes its calls after any content, each call's id and JSON arguments between special tokens:

    Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(one line in reality). The id is kept as the call's id, as vLLM does (the chat template renders it back in the next
turn); the function's name is what lies between "functions." and ":". The parser reads text, so the request keeps
these five markers as text (`SamplingParams.keep_special_token_ids`; other special tokens are skipped as ever); any
other special token the text holds (a client that asked for `skip_special_tokens: false`) is dropped, and none
reaches the content.

`ToolCallStream` reads the text in pieces as it is generated: content as soon as it cannot be the start of a marker,
a call's id and name once its header is complete, then its arguments piece by piece. `parse_tool_calls` reads a
whole text. Malformed output (a stray or misplaced marker, a header that is not `name:index`, a call still open at
the end) never raises: the whole text is the content of `parse_tool_calls` (as vLLM's `extract_tool_calls`); a
stream, which cannot take back what it sent, sends the text from the broken call on as content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from .special_tokens import lexer_for

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENTS_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END)

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
    """One choice's text, fed in pieces (`feed`, then `finish` once), split into content and tool-call pieces."""

    def __init__(self, special_tokens: Iterable[str]) -> None:
        self.hidden = frozenset(special_tokens) - set(MARKERS)
        self._lexer = lexer_for(self.hidden | set(MARKERS))
        self._state = "content"  # content | section | header | arguments | broken
        self._pending = ""  # received text not read yet: the start of a marker, maybe
        self._unsent = ""  # read but not sent: markers and header of the call being read (content if it breaks)
        self._header = ""
        self._blank = ""  # whitespace at the end of the arguments so far: sent once more arguments follow
        self._arguments_begun = False  # the current call has sent argument text
        self.num_calls = 0  # calls whose header was sent
        self.num_complete = 0  # calls whose <|tool_call_end|> was read
        self.malformed = False

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        pieces, self._pending = self._lexer.split(self._pending + text)
        for piece, is_token in pieces:
            (self._read_token if is_token else self._read_text)(piece, out)
        return out

    def finish(self) -> ParsedDelta:
        """The end of the text: what was held back goes out as content; a call or a section left open with nothing
        in it is malformed."""
        out = ParsedDelta()
        rest, self._pending = self._unsent + self._blank + self._pending, ""
        if self._state in ("header", "arguments") or (self._state == "section" and self.num_complete == 0):
            self.malformed = True
        if self.malformed or self._state in ("content", "broken") or rest.strip():
            out.content += rest
        self._state = "broken"
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

    def _read_token(self, token: str, out: ParsedDelta) -> None:
        state = self._state
        if token in self.hidden:
            if state in ("header", "arguments"):
                self._break("", out)  # the turn ended inside a call
            return
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

    def without_hidden(self, text: str) -> str:
        """`text` without the special tokens that are not tool-call markers."""
        return self._lexer.pattern.sub(lambda m: "" if m.group() in self.hidden else m.group(), text)

    def _break(self, text: str, out: ParsedDelta) -> None:
        """Malformed: what was read of the broken call and everything after it is content."""
        self.malformed = True
        out.content += self._unsent + self._blank + text
        self._state, self._unsent, self._blank = "broken", "", ""


def parse_tool_calls(text: str, special_tokens: Iterable[str]) -> tuple[str, list[ParsedCall]]:
    """A whole text -> (its content, its tool calls). Malformed: (the whole text, no call)."""
    stream = ToolCallStream(special_tokens)
    content, calls = "", []
    for delta in (stream.feed(text), stream.finish()):
        content += delta.content
        for piece in delta.calls:
            if piece.id is not None:
                calls.append(ParsedCall(piece.id, piece.name, ""))
            calls[piece.index].arguments += piece.arguments
    if stream.malformed:
        return stream.without_hidden(text), []
    return content, calls
