"""Kimi K2's reasoning in generated text -> vLLM's `reasoning` (and `reasoning_content`), what vLLM serves with
`--reasoning-parser kimi_k2`, on /v1/chat/completions when the server runs with that parser (parsers.py; `auto` for a
checkpoint of K2's vocabulary). Kimi K3's XTML think channel is xtml.py's.

A Kimi thinking model (K2 Thinking, K3) writes its reasoning between the special tokens `<think>` and `</think>`,
then its answer, then any tool calls:

    <think>They want the weather: call get_weather.</think>Let me check.<|tool_calls_section_begin|>...

The reasoning goes to `reasoning`, the rest to `content` (and through the tool-call parser when the request
has tools); the markers reach neither. The rules:

- No marker at all: everything is content. That is why the parser can be on by default: a model that never thinks
  is served exactly as without it (the request keeps only the markers as text, `keep_special_token_ids`; every
  other special token is skipped token by token, as ever).
- A chat template may open the block itself (its generation prompt ends with `<think>`): then the choice starts in
  reasoning (`prompt_opens_reasoning`) and everything before the first `</think>` is reasoning. The prompt decides,
  not a guess from the output, because a stream cannot take back what it sent: vLLM's deepseek_r1 streaming calls
  all text reasoning until `</think>` shows, which would turn a non-thinking model's whole answer into reasoning.
- No `</think>` by the end: everything after `<think>` is reasoning (a turn cut by max_tokens while thinking).
- Kimi may start its tool calls without closing the block: `<|tool_calls_section_begin|>` ends the reasoning and
  goes on, with the rest, to the content (as vLLM's kimi_k2 parser splits at the tool-call marker).
- A `</think>` with no block open is dropped; a second block is reasoning too.

Any other special token in the text (there are some only when the client asked for `skip_special_tokens: false`)
is dropped from the reasoning; in the content it is kept when `keep_special` (the tool-call parser reads the
content next and drops those it does not use, or the client asked for them), else dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from .special_tokens import SECTION_BEGIN, THINK_BEGIN, THINK_END, Piece, SpecialTokenReader

TURN_END = "<|im_end|>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: list[Piece] = field(default_factory=list)  # lexed, for the tool-call parser next
    held_back: str = ""  # from `finish`: the content's end that never became a special token

    @property
    def content_text(self) -> str:
        return "".join([piece for piece, _ in self.content]) + self.held_back


class ReasoningStream:
    """One choice's text, fed in pieces (`feed`, then `finish` once), split into reasoning and content; it lexes the
    text, and hands the content on lexed (special_tokens.py)."""

    def __init__(self, special_tokens: Collection[str], *, in_reasoning: bool = False,
                 keep_special: bool = False) -> None:
        self._reader = SpecialTokenReader(special_tokens)
        self.in_reasoning = in_reasoning
        self.keep_special = keep_special

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        for piece, is_token in self._reader.feed(text):
            if is_token:
                self._read_token(piece, out)
            elif self.in_reasoning:
                out.reasoning += piece
            else:
                out.content.append((piece, False))
        return out

    def finish(self) -> ReasoningDelta:
        """The end of the text: what was held back never became a special token, so it is text."""
        held_back = self._reader.finish()
        return ReasoningDelta(reasoning=held_back) if self.in_reasoning else ReasoningDelta(held_back=held_back)

    def _read_token(self, token: str, out: ReasoningDelta) -> None:
        if token == THINK_BEGIN:
            self.in_reasoning = True
        elif token == THINK_END:
            self.in_reasoning = False
        else:
            if token == SECTION_BEGIN:
                self.in_reasoning = False  # tool calls end the reasoning, closed or not
            if self.keep_special and not self.in_reasoning:
                out.content.append((token, True))


def prompt_opens_reasoning(prompt_ids: Sequence[int], special_tokens: Mapping[str, int]) -> bool:
    """Whether the prompt leaves a think block open for the answer: its last `<think>`, `</think>` or `<|im_end|>`
    is `<think>` (a template whose generation prompt starts the reasoning)."""
    begin = special_tokens.get(THINK_BEGIN)
    closers = {special_tokens.get(THINK_END), special_tokens.get(TURN_END)} - {None}
    for token in reversed(prompt_ids):
        if token == begin:
            return True
        if token in closers:
            return False
    return False
