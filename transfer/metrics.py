"""Prometheus metrics of the transfer layer, all named `k3serve:transfer_*`.

PD_PRIOR_ART §7.8: transfer time and bytes hidden inside one connector's histograms give no
per-pool picture, so every transfer path (backends, pin manager, checksum check) reports here,
labelled by `model` and `role` ("prefill" or "decode"):

    k3serve:transfer_bytes_total                     counter    bytes posted and landed
    k3serve:transfer_seconds                         histogram  post -> last rank confirmed
    k3serve:transfer_failures_total{reason}          counter    aborts, lost peers, backend failures
    k3serve:transfer_pinned_blocks                   gauge      block pins held by in-flight transfers
    k3serve:transfer_pinned_slots                    gauge      slot pins held by in-flight transfers
    k3serve:transfer_lease_expiries_total            counter    leases released by the deadline sweep
    k3serve:transfer_checksum_mismatches_total       counter    regions whose landed bytes differ
    k3serve:transfer_integrity_failures_total{stage}  counter    adopted requests failed: state changed after
                                                                 its checks ("first_step": before the first
                                                                 decode step; "step": a random re-check)

The collectors are created once per registry: `transfer_metrics()` (the process-wide default
registry) returns the same object however often it is called or this module is imported, and
tests pass a fresh `CollectorRegistry` to count from zero. Gauges move by inc/dec, never set, so
several pin managers in one process (colocated prefill + decode) add up instead of overwriting.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

# post -> confirmed, seconds: a few MB over NVLink (~1 ms) up to a long prompt over TCP (~tens of s).
TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_LABELS = ("model_name", "role")


@dataclass(frozen=True)
class TransferMetrics:
    """The collectors of one registry. Call `bind(model, role)` to get the recording face."""

    bytes_total: Counter
    seconds: Histogram
    failures_total: Counter
    pinned_blocks: Gauge
    pinned_slots: Gauge
    lease_expiries_total: Counter
    checksum_mismatches_total: Counter
    integrity_failures_total: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> "TransferMetrics":
        return cls(
            bytes_total=Counter(
                "k3serve:transfer_bytes", "Bytes written by finished transfers.", _LABELS, registry=registry
            ),
            seconds=Histogram(
                "k3serve:transfer_seconds",
                "Seconds from posting a request's writes to the last rank's confirmation.",
                _LABELS,
                buckets=TRANSFER_SECONDS_BUCKETS,
                registry=registry,
            ),
            failures_total=Counter(
                "k3serve:transfer_failures",
                "Transfers that did not finish, by reason (abort, peer_lost, lease_expired, backend).",
                _LABELS + ("reason",),
                registry=registry,
            ),
            pinned_blocks=Gauge(
                "k3serve:transfer_pinned_blocks", "MLA block pins held by in-flight transfers.", _LABELS, registry=registry
            ),
            pinned_slots=Gauge(
                "k3serve:transfer_pinned_slots", "KDA slot pins held by in-flight transfers.", _LABELS, registry=registry
            ),
            lease_expiries_total=Counter(
                "k3serve:transfer_lease_expiries",
                "Pin leases released because their deadline passed without confirmation.",
                _LABELS,
                registry=registry,
            ),
            checksum_mismatches_total=Counter(
                "k3serve:transfer_checksum_mismatches",
                "Cache regions whose landed bytes did not match the sender's checksum.",
                _LABELS,
                registry=registry,
            ),
            integrity_failures_total=Counter(
                "k3serve:transfer_integrity_failures",
                "Adopted requests failed because their state changed after its checksums were verified.",
                (*_LABELS, "stage"),
                registry=registry,
            ),
        )

    def bind(self, model: str = "", role: str = "") -> "BoundTransferMetrics":
        return BoundTransferMetrics(self, model, role)


@dataclass(frozen=True)
class BoundTransferMetrics:
    """The collectors with `model` and `role` filled in: what the transfer code calls."""

    metrics: TransferMetrics
    model: str
    role: str

    def add_bytes(self, num_bytes: int) -> None:
        self.metrics.bytes_total.labels(self.model, self.role).inc(num_bytes)

    def observe_seconds(self, seconds: float) -> None:
        self.metrics.seconds.labels(self.model, self.role).observe(seconds)

    def failure(self, reason: str) -> None:
        self.metrics.failures_total.labels(self.model, self.role, reason).inc()

    def pins_changed(self, num_blocks: int, num_slots: int) -> None:
        """Add (positive) or remove (negative) block and slot pins."""
        self.metrics.pinned_blocks.labels(self.model, self.role).inc(num_blocks)
        self.metrics.pinned_slots.labels(self.model, self.role).inc(num_slots)

    def lease_expired(self) -> None:
        self.metrics.lease_expiries_total.labels(self.model, self.role).inc()

    def checksum_mismatch(self, num_regions: int = 1) -> None:
        self.metrics.checksum_mismatches_total.labels(self.model, self.role).inc(num_regions)

    def integrity_failure(self, stage: str) -> None:
        self.metrics.integrity_failures_total.labels(self.model, self.role, stage).inc()


_lock = threading.Lock()
_by_registry: "weakref.WeakKeyDictionary[CollectorRegistry, TransferMetrics]" = weakref.WeakKeyDictionary()


def transfer_metrics(registry: CollectorRegistry | None = None) -> TransferMetrics:
    """The transfer collectors of `registry` (default: prometheus_client's global REGISTRY),
    created on first use. Registering the same name twice raises in prometheus_client, so the
    objects are cached per registry; if another copy of this module already registered them on
    the global registry, those collectors are reused."""
    registry = REGISTRY if registry is None else registry
    with _lock:
        found = _by_registry.get(registry)
        if found is not None:
            return found
        try:
            metrics = TransferMetrics.create(registry)
        except ValueError:  # "Duplicated timeseries": a second import of this module registered them
            metrics = _reuse_registered(registry)
        _by_registry[registry] = metrics
        return metrics


def _reuse_registered(registry: CollectorRegistry) -> TransferMetrics:
    names = registry._names_to_collectors  # prometheus_client keeps no public lookup by name
    return TransferMetrics(
        bytes_total=names["k3serve:transfer_bytes"],
        seconds=names["k3serve:transfer_seconds"],
        failures_total=names["k3serve:transfer_failures"],
        pinned_blocks=names["k3serve:transfer_pinned_blocks"],
        pinned_slots=names["k3serve:transfer_pinned_slots"],
        lease_expiries_total=names["k3serve:transfer_lease_expiries"],
        checksum_mismatches_total=names["k3serve:transfer_checksum_mismatches"],
        integrity_failures_total=names["k3serve:transfer_integrity_failures"],
    )
