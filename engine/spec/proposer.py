"""Which requests speculate, and their drafts: the scheduler asks `Speculator.drafts` for each decode.

A request speculates when its verify rows sample exactly as plain decode rows would from the same logits: no
penalties and no logit_bias (they depend on the outputs so far, or are left to the plain path), and min_tokens
already met (its mask would change along the run). A structured output constraint does not stop it: the engine
masks each verify row by its matcher walked along the drafts (`StructuredOutputs.verify_mask`). Others decode
one token a step in the same batch. Engine thread.
"""

from __future__ import annotations

from typing import Protocol

from k3serve.engine.request import Request
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.engine.spec.ngram import NgramProposer


def can_speculate(request: Request) -> bool:
    p = request.sampling_params
    return p.logit_bias is None and not p.has_penalties and request.num_output_tokens >= p.min_tokens


class DraftProposer(Protocol):
    """Deterministic drafts (q a point mass): at most min(K, max_tokens) continuing `token_ids`, the request's
    prompt + outputs (which only grow); `release` forgets a finished request."""

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]: ...

    def release(self, request_id: str) -> None: ...


class Speculator:
    """`proposer`: the config's method's (prompt lookup), unless given."""

    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                                  config.prompt_lookup_max)

    def drafts(self, request: Request, max_tokens: int) -> list[int]:
        """At most min(K, `max_tokens`) drafts continuing the request, [] when it cannot speculate."""
        if max_tokens < 1 or not can_speculate(request):
            return []
        k = min(self.config.num_speculative_tokens, max_tokens)
        return self.proposer.propose(request.request_id, request.all_token_ids, k)[:k]

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)
