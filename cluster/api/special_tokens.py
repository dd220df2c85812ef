"""Special tokens in detokenized text, read in pieces as it streams (for tool_calls.py and reasoning.py).

Parsers of Kimi's output read the text a request was detokenized into with their markers kept: a marker such
as `<think>` or `<|tool_call_begin|>` is one token but may arrive split across stream pieces (a delta that ends
inside a held-back stop string, or a test that cuts anywhere). `SpecialTokenLexer.split` cuts text into plain text
and whole special tokens, and holds back an end that could still grow into one, so no parser ever shows half a
marker.
"""

from __future__ import annotations

import functools
import re


class SpecialTokenLexer:
    """Finds the special tokens of one vocabulary in text (the longest one where two start at the same place)."""

    def __init__(self, tokens: frozenset[str]) -> None:
        self.pattern = re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))
        self._prefixes = frozenset(t[:k] for t in tokens for k in range(1, len(t)))
        self._max_prefix = max(map(len, self._prefixes), default=0)

    def split(self, text: str) -> tuple[list[tuple[str, bool]], str]:
        """`text` as (piece, is_special_token) in order, and its end that could still grow into a special token (to
        be put before the next text)."""
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


@functools.lru_cache(maxsize=8)
def lexer_for(tokens: frozenset[str]) -> SpecialTokenLexer:
    """One lexer a vocabulary, not one a choice (Kimi's has 256 reserved special tokens)."""
    return SpecialTokenLexer(tokens)
