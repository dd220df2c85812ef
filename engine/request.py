"""One request's state as the scheduler sees it: tokens, progress, and the resources it holds.

A request owns at most one KDA working slot (`slot_id`) and a block table (`block_ids`) of
paged MLA latent KV. Its progress is one number, `num_computed_tokens`, which catches up with
`num_tokens` (prompt + outputs); there are no phases (see `scheduler.py`).

    all_token_ids:  | prompt_token_ids ............ | output_token_ids ... |
                    |<-- num_computed_tokens -->|  (KV written, KDA state advanced)
                    |<----------------------- num_tokens ----------------->|
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3serve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again, to be recomputed from token 0 (or a prefix hit)
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id, or a stop string (detokenizer)
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASON

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
FINISH_STATUS = {reason: status for status, reason in _FINISH_REASON.items()}
"""finish_reason string ("stop" | "length" | "abort") -> finished RequestStatus."""


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]  # [num_prompt_tokens]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)  # [num_output_tokens]
    arrival_order: int = -1  # set by Scheduler.add_request; FCFS and preemption order
    num_computed_tokens: int = 0  # tokens whose KV is in block_ids and state is in slot_id
    block_ids: list[int] = field(default_factory=list)  # [ceil(num_computed_tokens / block_size)] at least
    slot_id: int | None = None  # KDA working slot while RUNNING
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    num_cached_tokens: int = 0  # prefix-cache hit length at the first admission
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids must not be empty")
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def set_finished(self, status: RequestStatus) -> None:
        self.status = status
        self.finish_reason = _FINISH_REASON[status]
