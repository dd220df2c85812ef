"""Speculative decoding's metrics, by vLLM's names, and the engine's running totals behind its mean acceptance length.

    vllm:spec_decode_num_drafts_total                       counter  verify rows (one a speculating request a step)
    vllm:spec_decode_num_draft_tokens_total                 counter  drafts proposed in them
    vllm:spec_decode_num_accepted_tokens_total              counter  drafts accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total      counter  by draft position (label `position`, from 0)
    k3serve:spec_decode_acceptance_length                   histogram tokens a verify row emitted (accepted + 1)

Collectors live in the process's default registry (as `structured_output_metrics.py`'s): a colocated ingress
includes them (`cluster/serve.py`). Engine thread.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

ACCEPTANCE_LENGTH_BUCKETS = tuple(float(n) for n in range(1, 10))  # 1..K+1 tokens a verify row, K <= 8


@dataclass(frozen=True)
class SpecDecodeMetrics:
    num_drafts: Counter
    num_draft_tokens: Counter
    num_accepted_tokens: Counter
    num_accepted_tokens_per_pos: Counter
    acceptance_length: Histogram

    @property
    def collectors(self) -> tuple[Counter | Histogram, ...]:
        return (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.num_accepted_tokens_per_pos,
                self.acceptance_length)


@functools.cache
def spec_decode_metrics(registry: CollectorRegistry = REGISTRY) -> SpecDecodeMetrics:
    """The collectors of `registry` (default: the process's), created once."""
    return SpecDecodeMetrics(
        num_drafts=Counter("vllm:spec_decode_num_drafts", "Verify rows: a speculating request's drafts checked "
                           "in one step.", ("model_name",), registry=registry),
        num_draft_tokens=Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", ("model_name",),
                                 registry=registry),
        num_accepted_tokens=Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                    ("model_name",), registry=registry),
        num_accepted_tokens_per_pos=Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                            "Draft tokens accepted, by their position in the draft (from 0).",
                                            ("model_name", "position"), registry=registry),
        acceptance_length=Histogram("k3serve:spec_decode_acceptance_length", "Tokens a verify row emitted: its "
                                    "accepted drafts + 1.", ("model_name",), buckets=ACCEPTANCE_LENGTH_BUCKETS,
                                    registry=registry),
    )


@dataclass
class SpecDecodeStats:
    """One engine's totals, recorded into the collectors as they grow. Every engine has one, speculating or not:
    its series are exported from the start, at 0 (the deploy files' metric list holds for every replica)."""

    metrics: SpecDecodeMetrics
    model_name: str
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        m = self.metrics
        for collector in (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens, m.acceptance_length):
            collector.labels(self.model_name)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verify row: `num_draft_tokens` drafts, the first `num_accepted` of them accepted."""
        m, name = self.metrics, self.model_name
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        m.num_drafts.labels(name).inc()
        m.num_draft_tokens.labels(name).inc(num_draft_tokens)
        m.num_accepted_tokens.labels(name).inc(num_accepted)
        m.acceptance_length.labels(name).observe(num_accepted + 1)
        self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
            m.num_accepted_tokens_per_pos.labels(name, str(position)).inc()

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verify row emitted on average (vLLM's mean acceptance length: 1 + accepted / drafts)."""
        return None if self.num_drafts == 0 else 1.0 + self.num_accepted_tokens / self.num_drafts
