"""The ingress's autoscaler: each autoscaled pool's controller ticked on the router's load, replicas started
and drained to match.

    every interval_s, per pool:  load = router.load(pool, signal)
                                 desired = ScalingController.decide(load, current)     (cluster/autoscaling.py)
                                 current < desired: start replicas (`ReplicaLauncher`); each joins routing once
                                                    it answers its stats
                                 current > desired: drain the newest replicas (`DisaggregatedRouter.drain`: routed
                                                    nothing new, their requests run to their end), then stop them;
                                                    not while one of the pool's replicas is still starting (the
                                                    load fell during its start: it is the one to go, once up)

`current` counts the replicas serving or starting, not those draining. On a Ray cluster with an autoscaler
(KubeRay `enableInTreeAutoscaling`) the launcher asks for the desired replicas' resources
(`ray.autoscaler.sdk.request_resources`) at every change, so the pool's worker group grows its pods before a
start places its ranks, and the request shrinks with a scale-down: the pods it frees are the Ray autoscaler's
to give back once idle. Design:
docs/design/autoscaling.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Callable

from k3serve.cluster.autoscaling import SLO_QUANTILE, SLO_SIGNALS, PoolAutoscaling, ScalingController, ScalingDecision
from k3serve.cluster.latency_window import HistogramWindow
from k3serve.cluster.metrics import IngressMetrics

log = logging.getLogger(__name__)

Stop = Callable[[], None]
Build = Callable[[str, str], tuple[Any, Stop]]  # (pool, replica name) -> (replica, its stop); blocks until built
_UP_TIMEOUT_S = 60.0  # a built replica's first stats answer


class ReplicaLauncher:
    """Starts and stops a deployment's replicas and holds the stop of every one still running.
    `build(pool, name)` (called on a worker thread) returns a replica that is up and its stop;
    `request_resources(counts)` (optional) is told every autoscaled pool's replica count at every change."""

    def __init__(self, build: Build, request_resources: Callable[[dict[str, int]], None] | None = None) -> None:
        self.build, self.request_resources = build, request_resources
        self._stops: dict[str, Stop] = {}

    def adopt(self, name: str, stop: Stop) -> None:
        """A replica started elsewhere (the deployment's first ones), stopped by `stop` or `stop_all`."""
        self._stops[name] = stop

    async def start(self, pool: str, name: str) -> Any:
        """A new replica of `pool`, once it answers its stats (it can take requests)."""
        replica, stop = await asyncio.to_thread(self.build, pool, name)
        self._stops[name] = stop
        try:
            await asyncio.wait_for(replica.stats(), _UP_TIMEOUT_S)
        except BaseException:
            await self.stop(name)
            raise
        return replica

    async def stop(self, name: str) -> None:
        stop = self._stops.pop(name, None)
        if stop is not None:
            await asyncio.to_thread(stop)

    def stop_all(self) -> None:
        """Stop every replica still running, the newest first (Deployment.shutdown)."""
        while self._stops:
            name, stop = self._stops.popitem()
            try:
                stop()
            except Exception as e:  # keep stopping the rest
                log.warning("stopping replica %s failed: %r", name, e)


class Autoscaler:
    """Runs in the ingress's event loop (`start`, `close`). `rules`: the autoscaled pools' rules; `router`: the
    DisaggregatedRouter whose replica lists it changes; `next_index`: the index the pool's next replica is
    named with (`{pool}-{index}`), past those the deployment started. `clock` goes to the controllers and the
    SLO signals' windows (`slo_window_s` long, over `metrics`' latency histograms); `drain_timeout_s` bounds a
    removed replica's wait for its requests."""

    def __init__(self, router: Any, rules: dict[str, PoolAutoscaling], launcher: ReplicaLauncher,
                 metrics: IngressMetrics, next_index: dict[str, int], drain_timeout_s: float,
                 interval_s: float = 1.0, clock: Callable[[], float] | None = None,
                 slo_window_s: float = 60.0) -> None:
        self.router, self.rules, self.launcher, self.metrics = router, rules, launcher, metrics
        self.drain_timeout_s, self.interval_s = drain_timeout_s, interval_s
        clock = clock or time.monotonic
        self.controllers = {pool: ScalingController(rule, clock) for pool, rule in rules.items()}
        labels = dict(zip(("model_name", "engine"), metrics.vllm_labels))
        self.latency = {pool: HistogramWindow(getattr(metrics, SLO_SIGNALS[rule.signal]), labels, slo_window_s, clock)
                        for pool, rule in rules.items() if rule.signal in SLO_SIGNALS}
        self._indices = {pool: itertools.count(next_index[pool]) for pool in rules}
        self._starting: dict[str, int] = dict.fromkeys(rules, 0)  # replicas being built, not yet routed
        self._changes: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self.decisions: dict[str, ScalingDecision] = {}  # each pool's last

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stop ticking and wait for the starts and drains under way (their replicas end up stopped or routed)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        await asyncio.gather(*self._changes, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # one bad tick must not end autoscaling
                log.exception("autoscaler tick failed")
            await asyncio.sleep(self.interval_s)

    def current(self, pool: str) -> int:
        """`pool`'s replicas serving or starting (those draining not counted)."""
        return len(self._routed(pool)) + self._starting[pool]

    def _routed(self, pool: str) -> list[str]:
        """The names of `pool`'s replicas in the router and not draining, oldest first."""
        return [r.name for r in self.router.replicas(pool) if not self.router.is_draining(r.name)]

    def tick(self) -> None:
        """One decision a pool, and the starts or drains it asks for (run as tasks)."""
        for pool, rule in self.rules.items():
            current = self.current(pool)
            value, load = self._signal(pool, rule.signal, current)
            decision = self.controllers[pool].decide(load, current)
            self.decisions[pool] = decision
            self.metrics.set_autoscaling(pool, rule.signal, value, decision.desired,
                                         len(self.router.replicas(pool)) + self._starting[pool])
            if decision.desired > current:
                self._ask_resources(pool, decision.desired)
                for _ in range(decision.desired - current):
                    self._starting[pool] += 1  # counted at once: the next tick sees it
                    self._spawn(self._add(pool))
            elif decision.desired < current and not self._starting[pool]:  # a start under way: not before it is up
                self._ask_resources(pool, decision.desired)  # what Ray keeps for the pool shrinks with it
                for name in self._routed(pool)[::-1][:current - decision.desired]:  # the newest go first
                    self.router.begin_drain(name)  # at once: the next tick does not choose it again
                    self._spawn(self._remove(pool, name))

    def _signal(self, pool: str, signal: str, current: int) -> tuple[float, float]:
        """The signal's value now and the pool's load it makes: the same for a load signal; for an SLO signal
        its p90 over the window, and that p90 x the replicas (cluster/autoscaling.py SLO_SIGNALS)."""
        if pool not in self.latency:
            load = self.router.load(pool, signal)
            return load, load
        window = self.latency[pool]
        window.sample()
        p90 = window.quantile(SLO_QUANTILE)
        return p90, p90 * current

    def _ask_resources(self, pool: str, desired: int) -> None:
        if self.launcher.request_resources is None:
            return
        counts = {p: self.current(p) for p in self.rules} | {pool: desired}
        try:
            self.launcher.request_resources(counts)
        except Exception as e:  # the cluster may have no autoscaler: placing the replica still tries
            log.warning("requesting resources for %s failed: %r", counts, e)

    def _spawn(self, change) -> None:
        task = asyncio.get_running_loop().create_task(change)
        self._changes.add(task)
        task.add_done_callback(self._changes.discard)

    async def _add(self, pool: str) -> None:
        name = f"{pool}-{next(self._indices[pool])}"
        try:
            replica = await self.launcher.start(pool, name)
            self.router.add_replica(pool, replica)
            log.info("autoscaler: %s joined the %s pool", name, pool)
        except Exception as e:
            log.warning("autoscaler: starting %s failed: %r", name, e)
        finally:
            self._starting[pool] -= 1

    async def _remove(self, pool: str, name: str) -> None:
        try:
            await self.router.drain(pool, name, self.drain_timeout_s)
            await self.launcher.stop(name)
            log.info("autoscaler: %s left the %s pool", name, pool)
        except Exception as e:
            log.warning("autoscaler: removing %s failed: %r", name, e)
