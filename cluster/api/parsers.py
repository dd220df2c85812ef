"""The chat output parsers by name, as vLLM's `--reasoning-parser` / `--tool-call-parser` name them.

    reasoning:  kimi_k2 (`<think>` block, reasoning.py)   kimi_k3 (XTML think channel, xtml.py)   none
    tool calls: kimi_k2 (`<|tool_call_begin|>`, tool_calls.py)   kimi_k3 (XTML tools channel, xtml.py)

`chat_parsers` resolves a server's settings once, at start: "auto" (and "kimi", the older name of the default)
picks the checkpoint's format from its tokenizer (`Tokenizer.chat_format`: a vocabulary with XTML's special tokens is
K3's, any other Kimi K2's). A chat choice then asks its `ChatParsers` for new streams (`reasoning_stream`,
`tool_call_stream`); the formatter holds them without knowing the format. Each parser names the special tokens the
request keeps in its text (`markers`): every other special token is still skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from .reasoning import ReasoningStream, prompt_opens_reasoning
from .special_tokens import SECTION_BEGIN, THINK_BEGIN, THINK_END, TOOL_MARKERS
from .tool_calls import ToolCallStream
from .xtml import XTML_TOKENS, XtmlReasoningStream, XtmlToolCallStream

AUTO = "auto"
REASONING_PARSERS = ("kimi_k2", "kimi_k3", "none")
TOOL_CALL_PARSERS = ("kimi_k2", "kimi_k3")
REASONING_PARSER_CHOICES = (AUTO, "kimi", *REASONING_PARSERS)  # "kimi": auto, its name before K3
TOOL_CALL_PARSER_CHOICES = (AUTO, *TOOL_CALL_PARSERS)

ReasoningParser = Union[ReasoningStream, XtmlReasoningStream]
ToolCallParser = Union[ToolCallStream, XtmlToolCallStream]


@dataclass(frozen=True)
class ChatParsers:
    """A server's resolved parsers: `reasoning` in REASONING_PARSERS, `tool_calls` in TOOL_CALL_PARSERS.
    `auto_tool_choice`: requests with tools and tool_choice "auto" are served (vLLM's --enable-auto-tool-choice)."""

    reasoning: str
    tool_calls: str
    auto_tool_choice: bool = True

    @property
    def xtml(self) -> bool:
        return self.tool_calls == "kimi_k3"

    def markers(self, reasoning: bool, tool_calls: bool) -> tuple[str, ...]:
        """The special tokens a request's text keeps for the parsers it is read with."""
        out: tuple[str, ...] = ()
        if reasoning:
            out += XTML_TOKENS if self.reasoning == "kimi_k3" else (THINK_BEGIN, THINK_END, SECTION_BEGIN)
        if tool_calls:
            out += XTML_TOKENS if self.xtml else TOOL_MARKERS
        return tuple(dict.fromkeys(out))

    def reasoning_stream(self, special_tokens: Mapping[str, int], prompt_ids: Sequence[int], *, thinking: bool,
                         keep_special: bool) -> ReasoningParser | None:
        """A choice's reasoning parser. K3: `thinking` (the prompt opened the think channel); K2: the prompt's last
        think marker says whether the answer starts in reasoning."""
        if self.reasoning == "kimi_k3":
            return XtmlReasoningStream(thinking)
        if self.reasoning == "kimi_k2":
            return ReasoningStream(special_tokens, in_reasoning=prompt_opens_reasoning(prompt_ids, special_tokens),
                                   keep_special=keep_special)
        return None

    def tool_call_stream(self, max_calls: int | None, calls_allowed: bool = True) -> ToolCallParser:
        """A choice's tool-call parser. `calls_allowed` false (K3 only: tool_choice "none" or no tools) still reads
        the tools channel out of the content, and drops its calls."""
        if self.xtml:
            return XtmlToolCallStream(max_calls, calls_allowed=calls_allowed)
        return ToolCallStream(max_calls)


def chat_parsers(chat_format: str, reasoning_parser: str = AUTO, tool_call_parser: str = AUTO,
                 enable_auto_tool_choice: bool = True) -> ChatParsers:
    """The parsers a server runs with, "auto" resolved by the checkpoint's `chat_format` (its tokenizer's:
    "kimi_k2" or "kimi_k3", which are also the parsers' names); ValueError for a name that
    is none of REASONING_PARSER_CHOICES / TOOL_CALL_PARSER_CHOICES, or for parsers of two formats."""
    if reasoning_parser not in REASONING_PARSER_CHOICES:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSER_CHOICES)}, "
                         f"got {reasoning_parser!r}")
    if tool_call_parser not in TOOL_CALL_PARSER_CHOICES:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSER_CHOICES)}, "
                         f"got {tool_call_parser!r}")
    native = chat_format
    reasoning = native if reasoning_parser in (AUTO, "kimi") else reasoning_parser
    tool_calls = native if tool_call_parser == AUTO else tool_call_parser
    if reasoning not in ("none", tool_calls):  # each format's reasoning parser hands its content on in its own form
        raise ValueError(f"reasoning_parser {reasoning} reads a different format than tool_call_parser {tool_calls}: "
                         "name the same format for both (or reasoning_parser none)")
    return ChatParsers(reasoning, tool_calls, enable_auto_tool_choice)
