"""The offload tiers' metrics, by vLLM's names where vLLM has them (its KV connector's prefix-cache counters), a
`tier` label each:

    vllm:external_prefix_cache_queries_total   counter  prompt tokens looked up in a tier (admissions that asked it)
    vllm:external_prefix_cache_hits_total      counter  prompt tokens a tier served (loads that verified)
    k3serve:kv_offload_bytes_total             counter  bytes copied, `direction` "out" (stores) or "in" (loads)
    k3serve:kv_offload_misses_total            counter  loads that did not verify (a miss, the prompt recomputed)

The device prefix cache's own `vllm:prefix_cache_queries` / `_hits` are counted at the ingress (cluster/metrics.py)
from every request's `num_cached_tokens`, whichever tier served it. Collectors live in the process's default
registry, as `spec/metrics.py`'s. Engine thread.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter


@dataclass(frozen=True)
class OffloadMetrics:
    queries: Counter
    hits: Counter
    bytes: Counter
    misses: Counter

    @property
    def collectors(self) -> tuple[Counter, ...]:
        return self.queries, self.hits, self.bytes, self.misses


@functools.cache
def offload_metrics(registry: CollectorRegistry = REGISTRY) -> OffloadMetrics:
    """The collectors of `registry` (default: the process's), created once."""
    labels = ("model_name", "tier")
    return OffloadMetrics(
        queries=Counter("vllm:external_prefix_cache_queries", "Prompt tokens looked up in an offload tier.", labels,
                        registry=registry),
        hits=Counter("vllm:external_prefix_cache_hits", "Prompt tokens served from an offload tier.", labels,
                     registry=registry),
        bytes=Counter("k3serve:kv_offload_bytes", "Prefix-unit bytes copied to (out) or from (in) an offload tier, "
                      "all TP ranks.", (*labels, "direction"), registry=registry),
        misses=Counter("k3serve:kv_offload_misses", "Offload loads that did not verify (checksum, entry gone, store "
                       "down): recomputed.", labels, registry=registry),
    )


@dataclass
class TierCounts:
    """One tier's totals in one engine (what tests and the benchmark read), recorded into the collectors."""

    metrics: OffloadMetrics
    model_name: str
    tier: str
    queries: int = 0
    hits: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    misses: int = 0

    def __post_init__(self) -> None:
        m, labels = self.metrics, (self.model_name, self.tier)
        m.queries.labels(*labels), m.hits.labels(*labels), m.misses.labels(*labels)
        m.bytes.labels(*labels, "out"), m.bytes.labels(*labels, "in")

    def query(self, num_tokens: int) -> None:
        self.queries += num_tokens
        self.metrics.queries.labels(self.model_name, self.tier).inc(num_tokens)

    def stored(self, num_bytes: int) -> None:
        self.bytes_out += num_bytes
        self.metrics.bytes.labels(self.model_name, self.tier, "out").inc(num_bytes)

    def loaded(self, num_tokens: int, num_bytes: int | None) -> None:
        """A load of a `num_tokens` unit: `num_bytes` moved, or None: it did not verify (a miss)."""
        labels = (self.model_name, self.tier)
        if num_bytes is None:
            self.misses += 1
            self.metrics.misses.labels(*labels).inc()
            return
        self.hits += num_tokens
        self.bytes_in += num_bytes
        self.metrics.hits.labels(*labels).inc(num_tokens)
        self.metrics.bytes.labels(*labels, "in").inc(num_bytes)
