"""What `k3serve status` reads from /metrics beyond the dashboards' series: latency over the last minute and each
replica's health.

    k3serve:latency_last_minute_seconds{model_name, metric="ttft"|"tpot"|"handoff", quantile="0.5"|"0.9"}
    k3serve:latency_last_minute_requests{model_name, metric}      observations in the window
    k3serve:replica_healthy{model_name, pool, replica}            1 if its last stats call answered, else 0

Why here and not a JSON route or two scrapes: a one-shot CLI cannot wait a minute between two scrapes of the
cumulative histograms, and a route would duplicate what /metrics already serves (and its auth rules); the
window is computed when /metrics is rendered. Dashboards and alerts keep computing their own windows from the
histograms (`histogram_quantile` over `rate`), so these families are not in deploy/metrics.txt.
The window keeps at most `MAX_SAMPLES` latest values a metric (memory bounded under any load).
Thread: `observe` and `collect` may run on different threads (a lock guards the samples).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

WINDOW_SECONDS = 60.0
MAX_SAMPLES = 10_000
LATENCIES = ("ttft", "tpot", "handoff")
QUANTILES = (0.5, 0.9)


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (sorted or not), interpolated between the two nearest ranks; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class StatusCollector:
    """A Prometheus collector of the families above; the ingress metrics feed it."""

    def __init__(self, model_name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.model_name, self.clock = model_name, clock
        self._lock = threading.Lock()
        self._samples: dict[str, deque[tuple[float, float]]] = {m: deque(maxlen=MAX_SAMPLES) for m in LATENCIES}
        self._healthy: dict[tuple[str, str], bool] = {}

    def observe(self, metric: str, seconds: float) -> None:
        with self._lock:
            self._samples[metric].append((self.clock(), seconds))

    def set_healthy(self, pool: str, replica: str, healthy: bool) -> None:
        with self._lock:
            self._healthy[(pool, str(replica))] = healthy

    def remove_replica(self, pool: str, replica: str) -> None:
        with self._lock:
            self._healthy.pop((pool, str(replica)), None)

    def window(self, metric: str) -> list[float]:
        """The values of `metric` observed in the last WINDOW_SECONDS (older ones are dropped)."""
        horizon = self.clock() - WINDOW_SECONDS
        with self._lock:
            samples = self._samples[metric]
            while samples and samples[0][0] < horizon:
                samples.popleft()
            return [value for _, value in samples]

    def collect(self) -> Iterator[Metric]:
        latency = GaugeMetricFamily("k3serve:latency_last_minute_seconds", "Quantiles of TTFT, TPOT and handoff "
                                    "time over the last minute, at the ingress (NaN: none observed).",
                                    labels=("model_name", "metric", "quantile"))
        counts = GaugeMetricFamily("k3serve:latency_last_minute_requests", "Observations of each latency in the "
                                   "last minute.", labels=("model_name", "metric"))
        for metric in LATENCIES:
            values = self.window(metric)
            counts.add_metric((self.model_name, metric), len(values))
            for q in QUANTILES:
                latency.add_metric((self.model_name, metric, str(q)), quantile(values, q))
        healthy = GaugeMetricFamily("k3serve:replica_healthy", "1 if the replica answered the router's last "
                                    "stats call, else 0.", labels=("model_name", "pool", "replica"))
        with self._lock:
            for (pool, replica), up in sorted(self._healthy.items()):
                healthy.add_metric((self.model_name, pool, replica), float(up))
        yield from (latency, counts, healthy)

    def describe(self) -> list[Metric]:
        return []  # computed at collection time
