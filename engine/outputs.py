"""Result types: vLLM-shaped `RequestOutput` / `CompletionOutput` for the offline `LLM` API,
`RequestDelta` for the streaming API and `EngineStats`, what an engine reports about itself.

Logprobs travel between sampler and engine as `TokenLogprobs` (plain lists, cheap to send
across processes); `TokenLogprobs.to_dict()` builds the vLLM form `{token_id: Logprob}` that
`CompletionOutput.logprobs` and `RequestOutput.prompt_logprobs` hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Logprob:
    """One token's log-probability, as in vLLM (`vllm.sequence.Logprob`)."""

    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-n in rank order.

    The chosen token appears twice when it is itself among the top-n, as in vLLM v1's
    `LogprobsLists`; `to_dict()` merges the duplicate.
    """

    token_ids: list[int]  # [1 + n]: chosen (sampled / actual prompt) token, then top-n
    logprobs: list[float]  # [1 + n]
    ranks: list[int]  # [1 + n]: 1-based rank in the full vocabulary

    @property
    def chosen_logprob(self) -> float:
        return self.logprobs[0]

    def to_dict(self, decoded_tokens: list[str] | None = None) -> dict[int, Logprob]:
        """vLLM form: {token_id: Logprob}, chosen token first; n or n + 1 entries."""
        out: dict[int, Logprob] = {}
        for i, (tid, lp, rank) in enumerate(zip(self.token_ids, self.logprobs, self.ranks)):
            if tid not in out:
                out[tid] = Logprob(lp, rank, decoded_tokens[i] if decoded_tokens is not None else None)
        return out


SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token
PromptLogprobs = list[dict[int, Logprob] | None]  # one per prompt token; the first is None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM `CompletionOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of chosen-token logprobs; None unless logprobs requested
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything about one request so far (vLLM `RequestOutput`); `outputs` has one entry (n=1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None  # prompt tokens served by a prefix-cache hit


@dataclass
class RequestDelta:
    """What one engine step added to one request, for the streaming API."""

    request_id: str
    new_token_ids: list[int]  # [num_new_tokens]
    new_text: str  # text completed by these tokens; may be "" (partial UTF-8 or held-back stop prefix)
    finished: bool
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs] | None  # [num_new_tokens]; None unless logprobs requested
    num_prompt_tokens: int
    num_output_tokens: int  # total generated so far, including new_token_ids
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first delta, if requested
    num_cached_tokens: int = 0  # prompt tokens served by a prefix-cache hit at first admission
    error: str | None = None  # the request failed (finish_reason "abort"): why; streams raise RequestFailedError


class RequestFailedError(RuntimeError):
    """The engine could not continue one request (its structured output constraint rejected the sampled
    token); every other request goes on."""


@dataclass(frozen=True)
class EngineStats:
    """What routing and the pool gauges need from one engine (plain values: it crosses processes)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_free_slots: int
    block_usage: float  # fraction of MLA blocks in use (incl. reservations and pins)
    slot_usage: float  # fraction of KDA slots in use
    num_reserved: int = 0  # decode: reservations waiting for their handoff
    spec_mean_acceptance_length: float | None = None  # tokens a verify row emitted on average; None: none yet
    settings: dict[str, str] = field(default_factory=dict)  # `LLMEngine.settings`: what `k3serve status` shows
