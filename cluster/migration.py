"""Request migration: a stream whose decode replica died continues on another one.

The continuation is a new request whose prompt is the original prompt followed by the tokens the client
already has; its prefill samples the next token and decode goes on from there. Its output is what the
uninterrupted request would have produced when the next token depends only on the tokens so far: greedy, or
seeded sampling (the seed is moved so position j of the continuation draws what position k + j would have,
`engine.seeds.continuation_seed`). `refusal` names the requests for which that does not hold; they end
with the replica's error as before. Why, and what an unseeded request gets: docs/design/migration.md.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from k3serve.engine.seeds import continuation_seed
from k3serve.engine.outputs import RequestDelta
from k3serve.engine.sampling_params import SamplingParams

MAX_MIGRATIONS = 3  # a request whose replicas keep dying ends with the last error after this many


def refusal(params: SamplingParams) -> str | None:
    """Why a request cannot be continued exactly from its tokens alone (None: it can)."""
    if params.structured_outputs is not None:
        return "its structured output constraint's matcher state is not carried over"
    if params.stop:
        return "its stop strings may hold back text the dead replica had not sent"
    if params.frequency_penalty or params.presence_penalty:
        return "its frequency/presence penalties count only the continuation's output"
    return None


@dataclasses.dataclass(frozen=True)
class Continuation:
    """The request that continues `prompt_token_ids` + `sent_token_ids` (what the client already has)."""

    prompt_token_ids: list[int]  # the original prompt, then the tokens sent
    params: SamplingParams  # what is left of the original's budget, its seed moved on
    num_prompt_tokens: int  # the original prompt's length, which the client's deltas report
    num_sent_tokens: int

    @classmethod
    def of(cls, prompt_token_ids: Sequence[int], params: SamplingParams,
           sent_token_ids: Sequence[int]) -> "Continuation":
        k = len(sent_token_ids)
        changes: dict = {"min_tokens": max(0, params.min_tokens - k), "prompt_logprobs": None}
        if params.max_tokens is not None:
            changes["max_tokens"] = params.max_tokens - k
        if params.seed is not None:
            changes["seed"] = continuation_seed(params.seed, k)
        return cls([*prompt_token_ids, *sent_token_ids], dataclasses.replace(params, **changes),
                   len(prompt_token_ids), k)

    def delta(self, delta: RequestDelta) -> RequestDelta:
        """A continuation's delta as the original request's: its counts from the original prompt."""
        return dataclasses.replace(delta, num_prompt_tokens=self.num_prompt_tokens,
                                   num_output_tokens=delta.num_output_tokens + self.num_sent_tokens,
                                   prompt_logprobs=None)
