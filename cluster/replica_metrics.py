"""Worker-side metrics (the transfer layer's counters, pins, histograms), re-exported by the ingress.

Workers live in other processes (Ray actors) with registries of their own; the ingress is the one
/metrics endpoint users scrape. Each worker renders its `k3serve:` families as Prometheus text;
the router fetches that text with the replica stats; this collector merges the families of all
replicas into the ingress registry, adding a `replica` label so series stay distinct.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

PREFIX = ("k3serve:", "vllm:spec_decode_", "vllm:external_prefix_cache_")  # ours, and vLLM's names of
# speculative decoding's and the offload tiers' (engine/offload/metrics.py)


def render_worker_metrics(registry: CollectorRegistry = REGISTRY) -> str:
    """This process's `PREFIX` families as exposition text (what a worker sends)."""
    text = generate_latest(registry).decode()
    keep, current = [], False
    for line in text.splitlines():
        if line.startswith("# "):
            current = line.split()[2].startswith(PREFIX)
        if current:
            keep.append(line)
    return "\n".join(keep) + "\n"


class ReplicaMetricsCollector:
    """Registered once in the ingress registry; `update` stores the latest text of a replica."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._texts: dict[str, str] = {}
        if registry is not None:
            registry.register(self)

    def update(self, replica: str, text: str) -> None:
        self._texts[replica] = text

    def remove(self, replica: str) -> None:
        self._texts.pop(replica, None)

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, text in sorted(self._texts.items()):
            for family in text_string_to_metric_families(text):
                out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value)
        return list(merged.values())

    def describe(self):
        return []  # dynamic families: registered without a fixed description
