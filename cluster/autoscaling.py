"""A pool's autoscaling rule and the controller that turns its signal into a replica count.

    desired = clamp(ceil(load / target), min_replicas, max_replicas)     load: the pool's total signal

The signal is a per-replica load (`SIGNALS`), summed over the pool's serving replicas: prompt tokens in
flight on the prefill pool, running sequences on the decode pool, or its KV-block / KDA-slot usage (each
replica's ratio, so a target of 0.7 keeps the pool's mean usage near 70%); or an SLO signal (`SLO_SIGNALS`:
TTFT p90 for prefill, TPOT p90 for decode, over a recent window, the target its SLO in seconds). A change is
made only after it has been wanted without a break for the pool's delay (scale-up, scale-down): a burst shorter than the
scale-up delay adds nothing, a lull shorter than the scale-down delay removes nothing. `ScalingController`
is pure (its clock injected); `cluster/autoscaler.py` runs one a pool. Design: docs/design/autoscaling.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Literal

PoolName = Literal["prefill", "decode"]
# Each pool's signals, in the units of its target: per replica.
SIGNALS: dict[str, tuple[str, ...]] = {
    "prefill": ("queued_prompt_tokens", "ttft_p90_seconds"),
    "decode": ("running_sequences", "kv_block_usage", "kda_slot_usage", "tpot_p90_seconds"),
}
# The SLO signals: a latency's p90 at the ingress (the IngressMetrics histogram named) against the target, the
# SLO in seconds. Not a per-replica load: the pool's load reads as p90 x replicas, so that
# desired = ceil(replicas x p90 / slo), the replicas that would bring the p90 to the SLO if latency fell as
# the pool grew.
SLO_SIGNALS = {"ttft_p90_seconds": "ttft", "tpot_p90_seconds": "tpot"}
SLO_QUANTILE = 0.9


@dataclass(frozen=True)
class PoolAutoscaling:
    """One pool's rule: replicas between min and max, `target` of `signal` per replica, the delays a wanted
    change must hold before it is made. Validated by ServeConfig (cluster/config.py)."""

    pool: PoolName
    signal: str
    target: float
    min_replicas: int
    max_replicas: int
    scale_up_delay_seconds: float
    scale_down_delay_seconds: float

    def wanted(self, load: float) -> int:
        """The replicas that bring `load` (the pool's total signal) to `target` each, within the bounds."""
        need = math.ceil(load / self.target - 1e-9) if load > 0 else 0
        return min(self.max_replicas, max(self.min_replicas, need))


@dataclass(frozen=True)
class ScalingDecision:
    """What the controller saw and decided at one tick: `desired` is the count to run now."""

    current: int
    wanted: int  # what the load asks for at this tick, before the delays
    desired: int
    load: float


class ScalingController:
    """One pool's decisions. `decide(load, current)` at every tick (any thread, one at a time): `desired`
    moves to the wanted count once the wanted count has stayed above (below) `current` for the scale-up
    (scale-down) delay; a tick where it does not resets that wait. Scaling down goes to the largest count
    wanted during the wait, so a lull's last quiet tick does not undershoot the load seen during it."""

    def __init__(self, rule: PoolAutoscaling, clock: Callable[[], float] = time.monotonic) -> None:
        self.rule, self.clock = rule, clock
        self._direction = 0  # +1 waiting to scale up, -1 down, 0 neither
        self._since = 0.0
        self._peak = 0  # the largest count wanted since a scale-down wait began

    def decide(self, load: float, current: int) -> ScalingDecision:
        now, wanted = self.clock(), self.rule.wanted(load)
        direction = (wanted > current) - (wanted < current)
        if direction != self._direction:
            self._direction, self._since, self._peak = direction, now, wanted
        self._peak = max(self._peak, wanted)
        desired = current
        if direction > 0 and now - self._since >= self.rule.scale_up_delay_seconds:
            desired = wanted
        elif direction < 0 and now - self._since >= self.rule.scale_down_delay_seconds:
            desired = self._peak
        if desired != current:
            self._direction = 0  # the next change waits its own delay
        return ScalingDecision(current, wanted, desired, load)
