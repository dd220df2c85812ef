"""A latency histogram's quantile over a recent window: what `histogram_quantile(q, rate(h[window]))` reads.

The autoscaler's SLO signals (cluster/autoscaling.py `SLO_SIGNALS`) read the ingress's own TTFT and TPOT
histograms (cluster/metrics.py), sampled at every tick: the quantile is over the observations between the
oldest sample still inside the window and now, interpolated linearly inside its bucket as Prometheus does
(an observation past the last finite bound reads as that bound).
"""

from __future__ import annotations

import bisect
import collections
import math
import time
from typing import Callable

from prometheus_client import Histogram


class HistogramWindow:
    """`histogram`'s series with these label values; `sample()` and `quantile()` from one thread (the ingress's
    loop)."""

    def __init__(self, histogram: Histogram, labels: dict[str, str], window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.histogram, self.labels, self.window_s, self.clock = histogram, labels, window_s, clock
        self._samples: collections.deque[tuple[float, list[float]]] = collections.deque()  # (time, cumulative)
        self._bounds: list[float] = []

    def sample(self) -> None:
        """Record the histogram's cumulative bucket counts now; forget samples older than the window needs."""
        now, counts = self.clock(), self._cumulative()
        self._samples.append((now, counts))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def quantile(self, q: float) -> float:
        """The q-quantile (0 < q < 1) of what was observed within the window; 0.0 when nothing was."""
        if len(self._samples) < 2:
            return 0.0
        first, last = self._samples[0][1], self._samples[-1][1]
        first = first or [0.0] * len(last)  # the series was made (its first observation) within the window
        counts = [b - a for a, b in zip(first, last)]
        total = counts[-1] if counts else 0.0
        if total <= 0:
            return 0.0
        rank = q * total
        i = bisect.bisect_left(counts, rank)
        upper = self._bounds[i]
        if math.isinf(upper):
            return self._bounds[-2] if len(self._bounds) > 1 else 0.0
        lower, below = (self._bounds[i - 1], counts[i - 1]) if i > 0 else (0.0, 0.0)
        in_bucket = counts[i] - below
        return lower + (upper - lower) * ((rank - below) / in_bucket if in_bucket else 1.0)

    def _cumulative(self) -> list[float]:
        buckets: list[tuple[float, float]] = []
        for metric in self.histogram.collect():
            for s in metric.samples:
                if s.name.endswith("_bucket") and all(s.labels.get(k) == v for k, v in self.labels.items()):
                    buckets.append((float(s.labels["le"]), s.value))
        buckets.sort()
        self._bounds = [bound for bound, _ in buckets]
        return [count for _, count in buckets]
