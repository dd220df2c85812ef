"""Prompt lookup drafts (vLLM's `ngram` method): find the longest suffix n-gram, min_n <= n <= max_n, earlier
in the request's tokens (prompt + output) and propose the tokens that followed its first occurrence.

The index is incremental: `NgramIndex.extend` adds the n-grams that a new token completes (O(max_n) a token),
and a proposal is max_n - min_n + 1 dictionary look-ups, not a scan of the context. Host only; engine thread.
"""

from __future__ import annotations


class NgramIndex:
    """One request's tokens and, per n-gram of length min_n..max_n that some token follows, where its first
    occurrence ends (the index of the token after it)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._first_end: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: list[int]) -> None:
        for token in token_ids:
            end = len(self.tokens)  # the n-grams ending just before `token` are now followed by it
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._first_end.setdefault(tuple(self.tokens[end - n : end]), end)
            self.tokens.append(token)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the first earlier occurrence of the longest suffix n-gram;
        [] when no suffix n-gram occurred before."""
        if max_tokens < 1:
            return []
        size = len(self.tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            end = self._first_end.get(tuple(self.tokens[size - n :]))
            if end is not None:
                return self.tokens[end : end + max_tokens]
        return []


class NgramProposer:
    """Drafts for many requests: one `NgramIndex` a request, fed the tokens it gained since the last call."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """Drafts continuing `token_ids` (the request's prompt + output so far, which only ever grows), at most
        min(K, max_tokens)."""
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.min_n, self.max_n)
        if len(token_ids) < len(index.tokens):
            raise ValueError(f"request {request_id!r} has {len(token_ids)} tokens, fewer than the "
                             f"{len(index.tokens)} its index has seen")
        index.extend(token_ids[len(index.tokens) :])
        return index.propose(min(self.num_speculative_tokens, max_tokens))

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    @property
    def num_indexed(self) -> int:
        """Requests with an index (a leak check: none once every request ended)."""
        return len(self._indexes)
