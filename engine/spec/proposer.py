"""Which requests speculate, and their drafts: the scheduler asks `Speculator.drafts` for each decode.

A request speculates when its verify rows sample exactly as plain decode rows would from the same logits: no
penalties and no logit_bias (they depend on the outputs so far, or are left to the plain path), and min_tokens
already met (its mask would change along the run). A structured output constraint does not stop it: the engine
masks each verify row by its matcher walked along the drafts (`StructuredOutputs.verify_mask`). Others decode
one token a step in the same batch. Engine thread.
"""

from __future__ import annotations

from typing import Protocol

import torch

from k3serve.engine.request import Request
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.engine.spec.drafter import Drafts
from k3serve.engine.spec.ngram import NgramProposer


def can_speculate(request: Request) -> bool:
    p = request.sampling_params
    return p.logit_bias is None and not p.has_penalties and request.num_output_tokens >= p.min_tokens


class DraftProposer(Protocol):
    """Deterministic drafts (q a point mass): at most min(K, max_tokens) continuing `token_ids`, the request's
    prompt + outputs (which only grow); `release` forgets a finished request."""

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]: ...

    def release(self, request_id: str) -> None: ...


class StoredDrafts:
    """A model-based drafter's proposals: the engine stores what the runner's drafter proposed after a step
    (`store`), the scheduler takes them at the next one (`propose`), only while the request still has the tokens
    they continue (a preempted request drafts again when its recompute reaches its last token)."""

    def __init__(self) -> None:
        self._drafts: dict[str, Drafts] = {}

    def store(self, drafts: dict[str, Drafts]) -> None:
        self._drafts.update(drafts)

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        drafts = self._drafts.get(request_id)
        if drafts is None or drafts.num_tokens != len(token_ids) or max_tokens < 1:
            return []
        return drafts.token_ids[:max_tokens]

    def draft_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        """[num_drafts, V]: the q rows of the request's first drafts, None for deterministic ones."""
        drafts = self._drafts.get(request_id)
        return None if drafts is None or drafts.probs is None else drafts.probs[:num_drafts]

    def release(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)

    @property
    def num_indexed(self) -> int:
        """Requests with stored drafts (a leak check: none once every request ended)."""
        return len(self._drafts)


class Speculator:
    """`proposer`: the config's method's (prompt lookup, or the drafts a model-based drafter stored), unless
    given."""

    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer | None = None) -> None:
        self.config = config
        if proposer is None:
            proposer = StoredDrafts() if config.model is not None else NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        self.proposer = proposer

    def drafts(self, request: Request, max_tokens: int) -> list[int]:
        """At most min(K, `max_tokens`) drafts continuing the request, [] when it cannot speculate."""
        if max_tokens < 1 or not can_speculate(request):
            return []
        k = min(self.config.num_speculative_tokens, max_tokens)
        return self.proposer.propose(request.request_id, request.all_token_ids, k)[:k]

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)
