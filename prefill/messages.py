"""What a prefill worker is asked and answers: plain values that cross processes (Ray actors) and that the
router builds and reads, so the ingress imports them without the worker (and its torch)."""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.engine.outputs import RequestDelta, TokenLogprobs
from k3serve.transfer.control import Reservation


@dataclass(frozen=True)
class HandoffTarget:
    """Where a request's state goes: a decode engine's control addresses (one per decode rank, rank
    order; rank 0 first) and its reservation. A single address string is accepted for a one-rank
    decode engine."""

    decode_addresses: tuple[str, ...]
    reservation: Reservation

    def __post_init__(self) -> None:
        addresses = (self.decode_addresses,) if isinstance(self.decode_addresses, str) else tuple(self.decode_addresses)
        if not addresses:
            raise ValueError("a handoff target needs at least one decode address")
        object.__setattr__(self, "decode_addresses", addresses)


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    finished: bool  # the request ended at its first token (EOS, stop, max_tokens=1): no handoff
    delta: RequestDelta | None  # the prefill engine's delta when `finished` (text, finish reason)
    num_prompt_tokens: int
    prefill_seconds: float  # queue + prompt compute, as seen by this worker
    transfer_seconds: float  # writes posted -> decode acknowledged every rank
    num_bytes: int
    first_logprobs: list[TokenLogprobs] | None = None  # of the first token, if logprobs were requested
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # of the prompt tokens, if asked (echo)
    num_cached_tokens: int = 0  # prompt tokens the prefill engine's prefix cache served
