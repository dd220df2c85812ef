"""Speculative decoding on the tiny model: a scripted proposer.

    ScriptedProposer(references, K)  drafts the non-speculative greedy continuation for the first a tokens and
                                     garbage after them, a cycling through 0..K: every accepted length occurs
    token_runs(outputs)              each output's token ids
(The self-repeating model prompt lookup needs is tests/conftest.py's `echo_checkpoint`.)
"""

from __future__ import annotations

from collections.abc import Sequence

VOCAB_SIZE = 512


class ScriptedProposer:
    def __init__(self, references: dict[tuple[int, ...], list[int]], num_speculative_tokens: int) -> None:
        self.references = references  # prompt -> its non-speculative greedy output
        self.k = num_speculative_tokens
        self.calls: dict[str, int] = {}
        self.released: set[str] = set()

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        prompt = next(p for p in self.references if tuple(token_ids[: len(p)]) == p)
        done = len(token_ids) - len(prompt)
        good = self.calls.get(request_id, 0) % (self.k + 1)
        self.calls[request_id] = self.calls.get(request_id, 0) + 1
        right = self.references[prompt][done : done + max_tokens]
        return [t if i < good else (t + 1) % VOCAB_SIZE for i, t in enumerate(right)]

    def release(self, request_id: str) -> None:
        self.released.add(request_id)


def token_runs(outputs: Sequence) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]
