"""Special tokens in detokenized text, read in pieces as it streams (for tool_calls.py and reasoning.py).

Parsers of Kimi's output read the text a request was detokenized into with their markers kept: a marker such
as `<think>` or `<|tool_call_begin|>` is one token but may arrive split across stream pieces (a delta that ends
inside a held-back stop string, or a test that cuts anywhere). `SpecialTokenLexer.split` cuts text into plain text
and whole special tokens, and holds back an end that could still grow into one, so no parser ever shows half a
marker; a choice's `SpecialTokenReader` carries that end to its next delta.

A choice's text is lexed once, by the first parser that reads it (the reasoning parser; without one, the chat
formatter's reader for the tool-call parser), which hands the pieces it does not keep on, lexed, to the tool-call
parser. So both read with one lexer: a vocabulary's special tokens and every marker of either parser.
"""

from __future__ import annotations

import collections
import re
from typing import Collection

THINK_BEGIN = "<think>"
THINK_END = "</think>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENTS_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
TOOL_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END)

Piece = tuple[str, bool]  # (text, is_special_token): plain text, or one whole special token


class SpecialTokenLexer:
    """Finds the special tokens of one vocabulary in text (the longest one where two start at the same place)."""

    def __init__(self, tokens: frozenset[str]) -> None:
        self.pattern = re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))
        self._prefixes = frozenset(t[:k] for t in tokens for k in range(1, len(t)))
        self._max_prefix = max(map(len, self._prefixes), default=0)

    def split(self, text: str) -> tuple[list[Piece], str]:
        """`text` as pieces in order, and its end that could still grow into a special token (to be put before the
        next text)."""
        pieces, start = [], 0
        for match in self.pattern.finditer(text):
            if match.start() > start:
                pieces.append((text[start : match.start()], False))
            pieces.append((match.group(), True))
            start = match.end()
        rest = text[start:]
        cut = len(rest) - self._held_back_len(rest)
        if cut:
            pieces.append((rest[:cut], False))
        return pieces, rest[cut:]

    def _held_back_len(self, text: str) -> int:
        """Length of the longest end of `text` that is the start of a special token."""
        for k in range(min(self._max_prefix, len(text)), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0


class SpecialTokenReader:
    """One choice's text, fed delta by delta (`feed`, then `finish` once), as pieces: an end that could still grow
    into a special token waits for the next delta."""

    def __init__(self, special_tokens: Collection[str]) -> None:
        self._lexer = lexer_for(special_tokens)
        self._held_back = ""

    def feed(self, text: str) -> list[Piece]:
        pieces, self._held_back = self._lexer.split(self._held_back + text)
        return pieces

    def finish(self) -> str:
        """The end of the text that was held back: it never became a special token, so it is text."""
        held_back, self._held_back = self._held_back, ""
        return held_back


_MAX_LEXERS = 8
_lexers: collections.OrderedDict[int, tuple[Collection[str], SpecialTokenLexer]] = collections.OrderedDict()


def lexer_for(special_tokens: Collection[str]) -> SpecialTokenLexer:
    """The lexer of a vocabulary's special tokens and the parsers' markers: one a vocabulary, shared by every choice
    and both parsers. Found by the identity of `special_tokens` (a tokenizer's, never changed once it is loaded; the
    entry holds it, so its id is not reused): Kimi's vocabulary has some 260 special tokens, and the keys built of
    them cost each chat choice ~15 us, the lexing of a dozen deltas."""
    entry = _lexers.get(id(special_tokens))
    if entry is None:
        tokens = frozenset(special_tokens) | {THINK_BEGIN, THINK_END, *TOOL_MARKERS}
        entry = _lexers[id(special_tokens)] = (special_tokens, SpecialTokenLexer(tokens))
        if len(_lexers) > _MAX_LEXERS:
            _lexers.popitem(last=False)
    _lexers.move_to_end(id(special_tokens))
    return entry[1]
