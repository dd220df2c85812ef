"""Prometheus metrics of grammar compilation, measured where it runs: an engine's `GrammarCompiler` threads.

    k3serve:structured_output_compile_seconds            histogram  compilations that finished (cache misses)
    k3serve:structured_output_grammar_cache_hits_total   counter    constraints served without compiling: cached,
                                                                    or sharing a compilation under way

The collectors live in the process's default registry, like the transfer layer's: a prefill or decode worker
sends them to the disaggregated ingress with its other `k3serve:` families (cluster/replica_metrics.py, which adds
the `replica` label); a colocated ingress registers them in its own registry (`IngressMetrics.include`). Whether a
request was constrained, and refused for a constraint that does not compile, is counted at the ingress
(cluster/metrics.py), which sees every request once.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

# A small regex or choice compiles in ~1 ms; a schema at K3's vocabulary in tens to hundreds of ms; the first
# compilation of an engine also builds the vocabulary (~1 s); a pathological grammar may take many seconds.
COMPILE_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class GrammarCompileMetrics:
    """The collectors of one registry; `bind(model_name)` gives what a compiler records into."""

    seconds: Histogram
    cache_hits: Counter

    def bind(self, model_name: str) -> "BoundGrammarCompileMetrics":
        self.seconds.labels(model_name)  # exported from the start, at 0
        self.cache_hits.labels(model_name)
        return BoundGrammarCompileMetrics(self, model_name)

    @property
    def collectors(self) -> tuple[Histogram, Counter]:
        return self.seconds, self.cache_hits


@dataclass(frozen=True)
class BoundGrammarCompileMetrics:
    metrics: GrammarCompileMetrics
    model_name: str

    def observe_compile(self, started: float) -> None:
        """A compilation that began at `started` (time.perf_counter) finished now."""
        self.metrics.seconds.labels(self.model_name).observe(time.perf_counter() - started)

    def cache_hit(self) -> None:
        self.metrics.cache_hits.labels(self.model_name).inc()


@functools.cache
def grammar_compile_metrics(registry: CollectorRegistry = REGISTRY) -> GrammarCompileMetrics:
    """The collectors of `registry` (default: the process's), created once: a name registers once a registry."""
    return GrammarCompileMetrics(
        seconds=Histogram("k3serve:structured_output_compile_seconds",
                          "Seconds an engine took to compile a structured output constraint (cache misses; an "
                          "engine's first also builds its vocabulary).", ("model_name",),
                          buckets=COMPILE_SECONDS_BUCKETS, registry=registry),
        cache_hits=Counter("k3serve:structured_output_grammar_cache_hits",
                           "Constraints an engine served without compiling them: cached, or being compiled for "
                           "another request.", ("model_name",), registry=registry),
    )
