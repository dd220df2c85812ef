"""Kimi K3's output format (XTML) -> reasoning, content and tool calls (what vLLM serves with `--reasoning-parser
kimi_k3 --tool-call-parser kimi_k3`).

K3 writes its turn as channels whose brackets are the special tokens `<|open|>`, `<|close|>` and `<|sep|>`:

    <|open|>think<|sep|>They want the weather.<|close|>think<|sep|>
    <|open|>response<|sep|>Let me check.<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>
      <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>

(one line in reality). The prompt opens the first channel (model/xtml_chat.py): `think` with thinking on, so the
output starts inside it with no open marker, `response` with thinking off. `XtmlReasoningStream` splits off the think
channel; `XtmlToolCallStream` unwraps the response channel into content and reads the tools channel's calls:
`type="string"` argument values are raw text, any other type JSON (raw text where it does not parse), attribute
values unescape `&quot;` and `&amp;`; a call is sent whole once its `<|close|>call<|sep|>` is read, with its
arguments as one JSON object, as vLLM streams them.

The rules are vLLM 0.32's (tests/data/k3_parser_goldens.json holds its results on a corpus) wherever a stream can
follow them: both modes here are one stream, whole text = the stream's pieces put together, at any cut. Where vLLM's
non-streamed parse looks back (it drops text it would already have streamed) the stream's reading is kept (the
corpus has a case of each, test_k3_parser_goldens.STREAM_READINGS):
- text before a think-open marker that is not at the start is reasoning (vLLM drops it);
- `<|open|>response<|sep|>` or `<|open|>tools<|sep|>` end an unclosed think channel (vLLM then calls everything
  content and drops the reasoning text);
- a response opener after the content began is dropped as a stray marker (vLLM drops the content before it).
Markers are matched exactly (our detokenizer puts no spaces between special tokens; vLLM also allows `\\s*` in them).
Malformed or truncated output never raises: an unclosed call is not a call, an unclosed channel ends with the text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from k3serve.model.xtml_chat import CLOSE, OPEN, SEP

from .special_tokens import Piece
from .tool_calls import ParsedCall, ParsedDelta, ToolCallDelta

XTML_TOKENS = (OPEN, CLOSE, SEP)  # what the text must keep for these parsers
THINK_OPEN, THINK_CLOSE = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
RESPONSE_OPEN, RESPONSE_CLOSE = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
TOOLS_OPEN, TOOLS_CLOSE = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
MESSAGE_CLOSE = f"{CLOSE}message{SEP}"

_O, _C, _S = map(re.escape, (OPEN, CLOSE, SEP))
_UNTIL_SEP = rf"(?:(?!{_S}).)*?"
_CALL = re.compile(rf"{_O}\s*call\s+(?P<attrs>{_UNTIL_SEP}){_S}(?P<body>.*?){_C}\s*call\s*{_S}", re.DOTALL)
_ARGUMENT = re.compile(rf"{_O}\s*argument\s+(?P<attrs>{_UNTIL_SEP}){_S}(?P<value>.*?){_C}\s*argument\s*{_S}",
                       re.DOTALL)
_ATTRIBUTE = re.compile(r'(?P<key>\w+)="(?P<value>[^"]*)"')


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of one of `markers` (it may still become one)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest of `markers` in `text`: (position, marker), or None."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else None


@dataclass
class XtmlReasoningDelta:
    """A piece of the think channel, and the text after it (for the tool-call parser), as plain text pieces."""

    reasoning: str = ""
    content: list[Piece] = field(default_factory=list)
    held_back: str = ""  # always "": the reasoning parser holds nothing back at the end (as K2's may)

    @property
    def content_text(self) -> str:
        return "".join(piece for piece, _ in self.content) + self.held_back


class XtmlReasoningStream:
    """One choice's text (`feed`, then `finish` once) split into the think channel and the rest. `thinking`: the
    prompt opened the think channel (vLLM's `thinking` / `enable_thinking`); off, every piece is content."""

    _STARTS = (THINK_OPEN, RESPONSE_OPEN)
    _ENDS = (THINK_CLOSE, RESPONSE_OPEN, TOOLS_OPEN, THINK_OPEN)

    def __init__(self, thinking: bool = True) -> None:
        self._state = "start" if thinking else "content"  # start | reasoning | content
        self._pending = ""

    def feed(self, text: str) -> XtmlReasoningDelta:
        out = XtmlReasoningDelta()
        if self._state == "content":
            if text:
                out.content.append((text, False))
            return out
        self._pending += text
        self._advance(out, final=False)
        return out

    def finish(self) -> XtmlReasoningDelta:
        out = XtmlReasoningDelta()
        if self._state != "content":
            self._advance(out, final=True)  # an unclosed think channel: the rest is reasoning
        return out

    def _advance(self, out: XtmlReasoningDelta, final: bool) -> None:
        if self._state == "start":
            if not final and any(m.startswith(self._pending) and m != self._pending for m in self._STARTS):
                return  # could still become a start marker
            if self._pending.startswith(THINK_OPEN):
                self._pending = self._pending[len(THINK_OPEN):]
            elif self._pending.startswith(RESPONSE_OPEN):  # the model skipped thinking: no think channel
                self._state = "content"
                out.content.append((self._pending, False))
                self._pending = ""
                return
            self._state = "reasoning"
        while self._state == "reasoning":
            hit = _first(self._pending, self._ENDS)
            if hit is None:
                keep = 0 if final else _held_back(self._pending, self._ENDS)
                out.reasoning += self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return
            at, marker = hit
            out.reasoning += self._pending[:at]
            if marker == THINK_OPEN:  # a stray open inside the channel
                self._pending = self._pending[at + len(marker):]
                continue
            rest = self._pending[at + len(marker):] if marker == THINK_CLOSE else self._pending[at:]
            self._state, self._pending = "content", ""
            if rest:
                out.content.append((rest, False))


def _attributes(text: str) -> dict[str, str]:
    return {m["key"]: m["value"].replace("&quot;", '"').replace("&amp;", "&") for m in _ATTRIBUTE.finditer(text)}


def _decode_call(attrs: str, body: str) -> tuple[str, str] | None:
    """One call element -> (tool name, JSON arguments); None without a tool name."""
    name = _attributes(attrs).get("tool", "")
    arguments: dict = {}
    for match in _ARGUMENT.finditer(body):
        attr = _attributes(match["attrs"])
        key, kind, value = attr.get("key", ""), attr.get("type", "string"), match["value"]
        if kind == "string":
            arguments[key] = value
        else:
            try:
                arguments[key] = json.loads(value)
            except json.JSONDecodeError:
                arguments[key] = value
    return (name, json.dumps(arguments, ensure_ascii=False)) if name else None


class XtmlToolCallStream:
    """The text after the think channel (`read` of plain pieces, then `finish` once) -> content and tool calls;
    then `result`. `max_calls` (parallel_tool_calls false: 1) drops the calls past it; `calls_allowed` false
    (tool_choice "none", or no tools) drops every call, as vLLM does, while the tools channel stays out of the
    content."""

    # In the response channel: the tools channel ends it, as `<|close|>response<|sep|>` does where the channel was
    # opened in the text (where the prompt opened it, vLLM keeps text after a close as content); the message close
    # and a stray response opener are dropped.
    _CONTENT_MARKERS = (TOOLS_OPEN, RESPONSE_CLOSE, MESSAGE_CLOSE, RESPONSE_OPEN)

    def __init__(self, max_calls: int | None = None, calls_allowed: bool = True) -> None:
        self.max_calls = max_calls
        self.calls_allowed = calls_allowed
        self._state = "start"  # start | wrapped | bare | after_response | tools | done
        self._pending = ""
        self.num_calls = 0  # calls found (sent or not)
        self.num_complete = 0  # calls sent: each one is whole
        self._content: list[str] = []
        self._calls: list[ParsedCall] = []

    def read(self, pieces: list[Piece]) -> ParsedDelta:
        out = ParsedDelta()
        text = "".join(piece for piece, _ in pieces)
        if text:
            self._pending += text
            self._advance(out, final=False)
        return self._kept(out)

    def finish(self, held_back: str = "") -> ParsedDelta:
        out = ParsedDelta()
        self._pending += held_back
        self._advance(out, final=True)
        self._state, self._pending = "done", ""
        return self._kept(out)

    def result(self) -> tuple[str, list[ParsedCall]]:
        return "".join(self._content), list(self._calls)

    def _kept(self, out: ParsedDelta) -> ParsedDelta:
        self._content.append(out.content)
        return out

    def _advance(self, out: ParsedDelta, final: bool) -> None:
        while True:
            state = self._state
            if state == "start":
                if not final and RESPONSE_OPEN.startswith(self._pending) and self._pending != RESPONSE_OPEN:
                    return
                wrapped = self._pending.startswith(RESPONSE_OPEN)
                self._state = "wrapped" if wrapped else "bare"
                self._pending = self._pending[len(RESPONSE_OPEN):] if wrapped else self._pending
            elif state in ("wrapped", "bare"):
                hit = _first(self._pending, self._CONTENT_MARKERS)
                if hit is None:
                    keep = 0 if final else _held_back(self._pending, self._CONTENT_MARKERS)
                    out.content += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep:]
                    return
                at, marker = hit
                out.content += self._pending[:at]
                self._pending = self._pending[at + len(marker):]
                if marker == TOOLS_OPEN:
                    self._state = "tools"
                elif marker == RESPONSE_CLOSE and state == "wrapped":
                    self._state = "after_response"
            elif state == "after_response":  # the response channel is closed: only a tools channel may follow
                at = self._pending.find(TOOLS_OPEN)
                if at < 0:
                    keep = 0 if final else _held_back(self._pending, (TOOLS_OPEN,))
                    self._pending = self._pending[len(self._pending) - keep:]
                    return
                self._pending, self._state = self._pending[at + len(TOOLS_OPEN):], "tools"
            elif state == "tools":
                end = self._pending.find(TOOLS_CLOSE)
                section = self._pending if end < 0 else self._pending[:end]
                used = 0
                for match in _CALL.finditer(section):
                    self._read_call(match["attrs"], match["body"], out)
                    used = match.end()
                if end < 0:
                    self._pending = self._pending[used:]
                    return
                self._state, self._pending = "done", ""
            else:  # done: the tools channel is closed; what follows is neither content nor calls
                self._pending = ""
                return

    def _read_call(self, attrs: str, body: str, out: ParsedDelta) -> None:
        decoded = _decode_call(attrs, body)
        if decoded is None:
            return
        index = self.num_calls
        self.num_calls += 1
        if not self.calls_allowed or (self.max_calls is not None and index >= self.max_calls):
            return
        name, arguments = decoded
        call = ParsedCall(f"functions.{name}:{index}", name, arguments)
        self._calls.append(call)
        self.num_complete += 1
        out.calls.append(ToolCallDelta(len(self._calls) - 1, arguments, call.id, name))


def parse_xtml(text: str, thinking: bool, tools: bool = True) -> tuple[str, str, list[ParsedCall]]:
    """A whole K3 output -> (reasoning, content, tool calls), as a stream of it sends them."""
    reasoning = XtmlReasoningStream(thinking)
    calls = XtmlToolCallStream(calls_allowed=tools)
    first, last = reasoning.feed(text), reasoning.finish()
    calls.read(first.content + last.content)
    calls.finish()
    content, parsed = calls.result()
    return first.reasoning + last.reasoning, content, parsed
