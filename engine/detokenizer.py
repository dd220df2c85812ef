"""Incremental detokenization with stop strings, one instance per request.

Works on token bytes, not on decoded strings, so a UTF-8 character split across byte tokens
is emitted only once complete. Text flows through three stages:

    token bytes --utf-8 incremental decoder--> text --stop check--> emitted | held back
                 (incomplete bytes wait here)                       (a tail that could still
                                                                     become a stop string)

Invariant: every delta returned by `push` / `finish` is final. Concatenated they equal `text`,
and no delta ever contains a stop string, or part of one, that the final text drops.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from k3serve.engine.sampling_params import SamplingParams


class TokenBytes(Protocol):
    """What the detokenizer needs from a tokenizer (model/tokenizer.py's `Tokenizer` fits)."""

    def token_bytes(self, ids: list[int]) -> list[bytes]: ...


class IncrementalDetokenizer:
    """Feed generated token ids one at a time; get back the newly completed text.

    `special_token_ids` are dropped when `skip_special_tokens` (when not given, the tokenizer's
    `all_special_ids` if it has one), but for `keep_special_token_ids`. With `prompt_token_ids`, trailing bytes of the
    prompt that form an incomplete UTF-8 character are prepended, so a character split across
    the prompt/output boundary comes out whole (as part of the output text).
    """

    def __init__(
        self,
        tokenizer: TokenBytes,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        special_token_ids: Iterable[int] | None = None,
        keep_special_token_ids: Iterable[int] = (),
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got stop={self.stop!r}")
        self.include_stop_str_in_output = include_stop_str_in_output
        if special_token_ids is None:
            special_token_ids = getattr(tokenizer, "all_special_ids", ())
        self.special_token_ids = frozenset(special_token_ids) - frozenset(keep_special_token_ids)
        self.stopped_by: str | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # decoded output text (already truncated at a stop string once found)
        self._num_emitted = 0  # chars of _text returned so far
        self._is_finished = False
        if prompt_token_ids:
            self._decoder.decode(_incomplete_utf8_tail(self._bytes_of(prompt_token_ids[-4:])))

    @classmethod
    def for_request(cls, tokenizer: TokenBytes, prompt_token_ids: list[int] | None,
                    params: "SamplingParams") -> "IncrementalDetokenizer":
        """The detokenizer a request's SamplingParams ask for: special tokens skipped (but those it keeps) or not,
        and its stop strings."""
        return cls(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                   params.include_stop_str_in_output, keep_special_token_ids=params.keep_special_token_ids)

    @property
    def text(self) -> str:
        """Output text emitted so far; the final text once stopped or finished."""
        return self._text[: self._num_emitted]

    @property
    def is_finished(self) -> bool:
        return self._is_finished

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completed (often "")."""
        if self._is_finished:
            raise RuntimeError(f"push({token_id}) after the detokenizer finished (stopped_by={self.stopped_by!r})")
        if self.skip_special_tokens and token_id in self.special_token_ids:
            return ""
        return self._extend(self._decoder.decode(self.tokenizer.token_bytes([token_id])[0]))

    def finish(self) -> str:
        """End of generation (EOS, length, abort): flush held-back text and dangling bytes."""
        if self._is_finished:
            return ""
        delta = self._extend(self._decoder.decode(b"", final=True))  # dangling bytes -> U+FFFD
        if not self._is_finished:
            delta += self._text[self._num_emitted :]
            self._num_emitted = len(self._text)
            self._is_finished = True
        return delta

    def _extend(self, new_text: str) -> str:
        search_from = len(self._text)
        self._text += new_text
        hit = self._find_stop(search_from)
        if hit is not None:
            index, stop = hit
            self.stopped_by = stop
            self._text = self._text[: index + len(stop) if self.include_stop_str_in_output else index]
            self._is_finished = True
            end = len(self._text)
        else:
            end = len(self._text) - self._stop_prefix_len()
        delta = self._text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return delta

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        """Earliest stop string that ends inside the new text (ties: first in `stop`)."""
        best = None
        for stop in self.stop:
            index = self._text.find(stop, max(0, search_from - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _bytes_of(self, token_ids: list[int]) -> bytes:
        if self.skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self.special_token_ids]
        return b"".join(self.tokenizer.token_bytes(token_ids)) if token_ids else b""


def _incomplete_utf8_tail(data: bytes) -> bytes:
    """The trailing bytes of `data` that start a UTF-8 character but do not finish it."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the start of the last character
            needed = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            return data[-back:] if needed > back else b""
    return b""
