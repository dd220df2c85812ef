"""Prometheus metrics of the ingress: vLLM's families under vLLM's names and labels (`vllm:*`, labels
`model_name` and `engine`), k3serve's own (handoff, pools, errors, structured outputs) under `k3serve:*`.

Latencies are measured here, at the ingress, not on a decode replica: on a replica TTFT would
start after the remote prefill and under-report (PD_PRIOR_ART.md section 4).

    arrival ──queue──> prefill ──handoff──> first token ... token ... last token
    |<────────────── TTFT ──────────────────>|<── ITL ──>|
    |<──────────────────────────── e2e ──────────────────────────────>|
    TPOT = (last token - first token) / (num_output_tokens - 1)

The ingress is one vLLM engine to the tools that read these names: the `vllm:` series carry
`engine="0"` (INGRESS_ENGINE), and the scheduler gauges `vllm:num_requests_running`, `_waiting` and
`vllm:kv_cache_usage_perc` are this pod's totals over its replicas (`pod_gauges`): what the Gateway API
Inference Extension reads per pod (deploy/README.md). Per replica they are `k3serve:num_requests_running`
and friends with `pool` and `replica` labels (`k3serve status` and the pools dashboard read those), and
`vllm:cache_config_info` has one series a replica, its `engine` label naming it (`decode-0`).

The app drives one `RequestTimer` per HTTP request (`start_request`, `on_delta`, `finish` / `fail`),
whatever its number of choices. Queue, prefill and handoff times are only known to the serving layer,
which reports them with `observe_queue_time` and friends (the disaggregated router's queue time: arrival
to a decode reservation, which its prefill waits for, or to leaving its admission queue without one:
timed out, cancelled); it also sets the per-(pool, replica) gauges with `set_pool_stats` (dropped, and `k3serve:replica_stats_stale`
set, by `mark_stale` when a refresh fails; a colocated
engine's are read at each scrape: `watch_engine`, `refresh`), the requests its admission queue holds with
`set_ingress_queue` (`k3serve:num_requests_waiting{pool="ingress", replica="router"}`, counted in the pod's
`vllm:num_requests_waiting` too), and each replica's engine settings with `set_engine_settings`
(`k3serve:engine_config_info`, value 1, the settings in its labels; and `vllm:cache_config_info`), and each
replica's health with `set_replica_healthy`; `status` (cluster/status_metrics.py) exports those and TTFT / TPOT /
handoff quantiles over the last minute for `k3serve status`.
Structured outputs: the app counts each request with a constraint by its kind (`count_structured_output`:
json, json_object, regex, choice, grammar, or tool_choice for a forced tool choice) and, among them, those
refused with a 400 because the constraint does not compile (`count_structured_output_refusal`;
request_errors counts them too, by status only); how long the engines take to compile is measured on the
engines (engine/structured_output_metrics.py), which a colocated deployment adds here with `include`.

`legacy_names=True` (`--legacy-metric-names`, for one release) also exports the families this module
named `k3serve:*` before they took vLLM's names (LEGACY_NAMES), with their old labels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from k3serve.cluster.status_metrics import StatusCollector

if TYPE_CHECKING:
    from k3serve.engine.outputs import EngineStats

# vLLM v1's layouts (vllm/v1/metrics/buckets.py; Ray Serve LLM copies them)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)

VLLM_LABELS = ("model_name", "engine")
INGRESS_ENGINE = "0"
"""The `engine` label of the ingress's `vllm:` series: one ingress is one engine to vLLM's tools."""
POOL_LABELS = ("model_name", "pool", "replica")
ENGINE_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "kda_checkpoint_mode",
                   "num_gpu_blocks", "num_kda_slots", "block_size", "cuda_graphs", "speculative_config")
"""`LLMEngine.settings`' names: the labels `k3serve:engine_config_info` carries beside POOL_LABELS."""
CACHE_CONFIG = ("block_size", "enable_prefix_caching", "num_gpu_blocks")
"""The fields of vLLM's CacheConfig that `vllm:cache_config_info` carries (with `engine`, and `model_name` as every
series here), from ENGINE_SETTINGS."""

LEGACY_NAMES = {  # the vllm: family -> its k3serve: name before, with the old labels (no engine; finish_reason)
    "vllm:time_to_first_token_seconds": "k3serve:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "k3serve:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds": "k3serve:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds": "k3serve:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "k3serve:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds": "k3serve:request_prefill_time_seconds",
    "vllm:request_success": "k3serve:request_success",
    "vllm:prompt_tokens": "k3serve:prompt_tokens",
    "vllm:generation_tokens": "k3serve:generation_tokens",
}


def request_token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to max_model_len (`build_1_2_5_buckets`): token counts of one request."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's scheduler load, as its stats report it."""

    num_running: int
    num_waiting: int
    kv_block_usage: float  # fraction of its MLA KV blocks in use


def pod_gauges(loads: dict[tuple[str, str], ReplicaLoad], ingress_waiting: int) -> tuple[int, int, float]:
    """(running, waiting, kv_cache_usage) of the whole pod from its replicas' loads, keyed by (pool, replica):
    requests running on any replica; waiting on any replica or in the ingress's admission queue; the KV usage of
    the fullest pool, a pool's usage the mean of its replicas' (the pool that fills first is what refuses work)."""
    running = sum(load.num_running for load in loads.values())
    waiting = ingress_waiting + sum(load.num_waiting for load in loads.values())
    pools: dict[str, list[float]] = {}
    for (pool, _), load in loads.items():
        pools.setdefault(pool, []).append(load.kv_block_usage)
    usage = max((sum(u) / len(u) for u in pools.values()), default=0.0)
    return running, waiting, usage


class IngressMetrics:
    """All ingress series in one registry (a fresh one unless `registry` is given)."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "",
                 pools: Sequence[tuple[str, str]] = (), max_model_len: int = 1 << 20,
                 legacy_names: bool = False) -> None:
        """pools: (pool, replica) pairs whose gauges start at 0, e.g. [("prefill", "0"), ("decode", "0")].
        max_model_len: the top of the per-request token histograms' buckets."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.vllm_labels = (model_name, INGRESS_ENGINE)  # the values of VLLM_LABELS on every vllm: series
        reg, m, v = self.registry, ("model_name",), VLLM_LABELS

        def hist(name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = v) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        token_buckets = request_token_buckets(max_model_len)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Arrival to first generated token, at the ingress.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive token-bearing deltas.",
                        ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "(last - first token time) / (output tokens - 1) per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to last token, at the ingress.",
                        REQUEST_TIME_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Time waiting before prefill started.",
                               REQUEST_TIME_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds", "Prefill time (on the prefill pool).",
                                 REQUEST_TIME_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds", "First to last token of each choice.",
                                REQUEST_TIME_BUCKETS)
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt tokens of each choice.",
                                          token_buckets)
        self.request_generation_tokens = hist("vllm:request_generation_tokens", "Generated tokens of each choice.",
                                              token_buckets)
        self.max_generation_tokens = hist("vllm:request_max_num_generation_tokens",
                                          "The most tokens any choice of a request generated.", token_buckets)
        self.handoff_time = hist("k3serve:handoff_time_seconds", "KV + KDA state handoff from prefill to decode.",
                                 REQUEST_TIME_BUCKETS, m)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               (*v, "finished_reason"), registry=reg)
        self.errors = Counter("k3serve:request_errors", "Requests answered with an error, by HTTP status "
                              "(499: the client went away; 503 includes requests cut by a drain's timeout).", ("model_name", "status"),
                              registry=reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of served requests.", v, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", v, registry=reg)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                            "cache (every choice's prompt).", v, registry=reg)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served by a prefix-cache hit.",
                                         v, registry=reg)
        self.pod_running = Gauge("vllm:num_requests_running", "Requests running on any replica of this pod.", v,
                                 registry=reg)
        self.pod_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting on any replica of this pod or in "
                                 "its admission queue.", v, registry=reg)
        self.pod_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage of this pod's fullest pool "
                                  "(1 = 100%).", v, registry=reg)
        self.cache_config = Gauge("vllm:cache_config_info", "1 for each replica's engine (engine: pool-replica); "
                                  "its labels: vLLM's cache config fields.", ("model_name", "engine", *CACHE_CONFIG),
                                  registry=reg)
        self.running = Gauge("k3serve:num_requests_running", "Requests running on a replica.", POOL_LABELS,
                             registry=reg)
        self.waiting = Gauge("k3serve:num_requests_waiting", "Requests waiting on a replica (pool 'ingress': at "
                             "the disaggregated ingress, for room on a decode replica).", POOL_LABELS, registry=reg)
        self.kv_block_usage = Gauge("k3serve:kv_block_usage_ratio", "Fraction of MLA KV blocks in use.",
                                    POOL_LABELS, registry=reg)
        self.kda_slot_usage = Gauge("k3serve:kda_slot_usage_ratio", "Fraction of KDA state slots in use.",
                                    POOL_LABELS, registry=reg)
        self.spec_acceptance_length = Gauge("k3serve:spec_decode_mean_acceptance_length", "Tokens a replica's "
                                            "speculative verify rows emitted on average (set once it has run one).",
                                            POOL_LABELS, registry=reg)
        self.structured_outputs = Counter("k3serve:structured_output_requests", "Requests with a structured output "
                                          "constraint, by kind (tool_choice: a forced tool choice).",
                                          ("model_name", "kind"), registry=reg)
        self.structured_output_refusals = Counter("k3serve:structured_output_refusals", "Requests refused (400) "
                                                  "because their structured output constraint does not compile, by "
                                                  "kind.", ("model_name", "kind"), registry=reg)
        self.handoff_retries = Counter("k3serve:handoff_retries", "Handoffs attempted again, into a new "
                                       "reservation, after a prefill attempt failed.", m, registry=reg)
        self.migrations = Counter("k3serve:request_migrations", "Streams continued on another decode replica "
                                  "after theirs died.", m, registry=reg)
        self.replicas_healthy = Gauge("k3serve:replicas_healthy", "Replicas of a pool answering health checks and "
                                      "able to admit work (a decode replica whose room reservations have held, "
                                      "unmoving, for admission_stall_seconds is not counted).",
                                      ("model_name", "pool"), registry=reg)
        self.desired_replicas = Gauge("k3serve:desired_replicas", "Replicas the autoscaler wants for a pool "
                                      "(cluster/autoscaling.py: its signal against its target, after the delays).",
                                      ("model_name", "pool"), registry=reg)
        self.current_replicas = Gauge("k3serve:current_replicas", "Replicas of an autoscaled pool: serving, "
                                      "starting or draining.", ("model_name", "pool"), registry=reg)
        self.autoscaling_signal = Gauge("k3serve:autoscaling_signal", "An autoscaled pool's signal: its load summed "
                                        "over its serving replicas, or an SLO signal's p90 in seconds.",
                                        ("model_name", "pool", "signal"),
                                        registry=reg)
        self.engine_config = Gauge("k3serve:engine_config_info", "1 for each replica's engine; its labels: the "
                                   "settings the engine runs with (blocks and slots as its pools were made).",
                                   POOL_LABELS + ENGINE_SETTINGS, registry=reg)
        self._engine_settings: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {}
        self._loads: dict[tuple[str, str], ReplicaLoad] = {}
        self._ingress_waiting = 0
        self._watched: list[tuple[str, str, Callable[[], Awaitable[EngineStats]]]] = []
        self.stats_stale = Gauge("k3serve:replica_stats_stale", "1 while a replica's last stats refresh failed: its "
                                 "other per-replica series are dropped until it answers again.", POOL_LABELS,
                                 registry=reg)
        self.status = StatusCollector(model_name)  # last-minute latency and replica health, for `k3serve status`
        reg.register(self.status)
        for series in (self.ttft, self.itl, self.tpot, self.e2e, self.queue_time, self.prefill_time,
                       self.decode_time, self.request_prompt_tokens, self.request_generation_tokens,
                       self.max_generation_tokens, self.prompt_tokens, self.generation_tokens,
                       self.prefix_cache_queries, self.prefix_cache_hits):
            series.labels(*self.vllm_labels)  # exported from the start, at 0
        for series in (self.handoff_time, self.handoff_retries, self.migrations):
            series.labels(model_name)
        self._set_pod_gauges()
        for pool, replica in pools:
            self.set_pool_stats(pool, replica, 0, 0, 0.0, 0.0)
        if legacy_names:
            reg.register(LegacyNames([c for c in vars(self).values()
                                      if isinstance(c, MetricWrapperBase) and c._name in LEGACY_NAMES]))

    # ---- per request ------------------------------------------------------------------------
    def start_request(self) -> "RequestTimer":
        return RequestTimer(self)

    def count_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(int(status))).inc()

    def count_structured_output(self, kind: str) -> None:
        self.structured_outputs.labels(self.model_name, kind).inc()

    def count_structured_output_refusal(self, kind: str) -> None:
        self.structured_output_refusals.labels(self.model_name, kind).inc()

    def count_prefix_cache(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """One engine request's prompt looked up in a prefix cache, `num_cached_tokens` of it a hit."""
        self.prefix_cache_queries.labels(*self.vllm_labels).inc(num_prompt_tokens)
        self.prefix_cache_hits.labels(*self.vllm_labels).inc(num_cached_tokens)

    # ---- reported by the serving layer ------------------------------------------------------
    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.labels(*self.vllm_labels).observe(seconds)

    def observe_prefill_time(self, seconds: float) -> None:
        self.prefill_time.labels(*self.vllm_labels).observe(seconds)

    def observe_handoff_time(self, seconds: float) -> None:
        self.handoff_time.labels(self.model_name).observe(seconds)
        self.status.observe("handoff", seconds)

    def count_handoff_retry(self) -> None:
        self.handoff_retries.labels(self.model_name).inc()

    def count_migration(self) -> None:
        self.migrations.labels(self.model_name).inc()

    def set_pool_stats(self, pool: str, replica: str, num_running: int, num_waiting: int,
                       kv_block_usage: float, kda_slot_usage: float,
                       spec_mean_acceptance_length: float | None = None) -> None:
        """A replica's fresh stats (its stale mark cleared)."""
        labels = (self.model_name, pool, str(replica))
        if spec_mean_acceptance_length is not None:
            self.spec_acceptance_length.labels(*labels).set(spec_mean_acceptance_length)
        self.running.labels(*labels).set(num_running)
        self.waiting.labels(*labels).set(num_waiting)
        self.kv_block_usage.labels(*labels).set(kv_block_usage)
        self.kda_slot_usage.labels(*labels).set(kda_slot_usage)
        self.stats_stale.labels(*labels).set(0)
        self._loads[(pool, str(replica))] = ReplicaLoad(num_running, num_waiting, kv_block_usage)
        self._set_pod_gauges()

    def mark_stale(self, pool: str, replica: str) -> None:
        """A replica's stats refresh failed: its gauges go (a dead replica runs nothing; its last values would be
        phantoms) and it is marked stale."""
        self.remove_replica(pool, replica)
        self.stats_stale.labels(self.model_name, pool, str(replica)).set(1)

    def set_engine_settings(self, pool: str, replica: str, settings: dict[str, str]) -> None:
        """The replica's one `engine_config_info` and `cache_config_info` series, replacing its previous ones (a
        restarted replica's engine may have been given other pools)."""
        labels = (self.model_name, pool, str(replica), *(settings.get(name, "") for name in ENGINE_SETTINGS))
        cache = (self.model_name, f"{pool}-{replica}", *(settings.get(name, "") for name in CACHE_CONFIG))
        previous = self._engine_settings.get((pool, str(replica)))
        if previous != (labels, cache):
            self._remove_settings(pool, str(replica))
            self.engine_config.labels(*labels).set(1)
            self.cache_config.labels(*cache).set(1)
            self._engine_settings[(pool, str(replica))] = (labels, cache)

    def set_ingress_queue(self, num_waiting: int) -> None:
        self.waiting.labels(self.model_name, "ingress", "router").set(num_waiting)
        self._ingress_waiting = num_waiting
        self._set_pod_gauges()

    def set_replica_healthy(self, pool: str, replica: str, healthy: bool) -> None:
        self.status.set_healthy(pool, replica, healthy)

    def set_replicas_healthy(self, pool: str, num_healthy: int) -> None:
        self.replicas_healthy.labels(self.model_name, pool).set(num_healthy)

    def set_autoscaling(self, pool: str, signal: str, load: float, desired: int, current: int) -> None:
        self.autoscaling_signal.labels(self.model_name, pool, signal).set(load)
        self.desired_replicas.labels(self.model_name, pool).set(desired)
        self.current_replicas.labels(self.model_name, pool).set(current)

    def remove_replica(self, pool: str, replica: str) -> None:
        """Every per-replica series of `replica` goes (its stale mark too)."""
        labels = (self.model_name, pool, str(replica))
        for gauge in (self.running, self.waiting, self.kv_block_usage, self.kda_slot_usage, self.stats_stale,
                      self.spec_acceptance_length):
            try:
                gauge.remove(*labels)
            except KeyError:
                pass
        self.status.remove_replica(pool, replica)
        self._loads.pop((pool, str(replica)), None)
        self._set_pod_gauges()
        self._remove_settings(pool, str(replica))

    def _remove_settings(self, pool: str, replica: str) -> None:
        previous = self._engine_settings.pop((pool, replica), None)
        if previous is not None:
            self.engine_config.remove(*previous[0])
            self.cache_config.remove(*previous[1])

    def _set_pod_gauges(self) -> None:
        running, waiting, usage = pod_gauges(self._loads, self._ingress_waiting)
        self.pod_running.labels(*self.vllm_labels).set(running)
        self.pod_waiting.labels(*self.vllm_labels).set(waiting)
        self.pod_kv_usage.labels(*self.vllm_labels).set(usage)

    def watch_engine(self, pool: str, replica: str, stats: Callable[[], Awaitable["EngineStats"]]) -> None:
        """Read an in-process engine's stats (a colocated deployment's) at every `refresh`, for its pool gauges and
        settings, as the disaggregated router reports its replicas'."""
        self._watched.append((pool, replica, stats))

    async def refresh(self) -> None:
        """Before a scrape: the watched engines' stats now (`watch_engine`)."""
        for pool, replica, stats in self._watched:
            s = await stats()
            self.set_pool_stats(pool, replica, s.num_running, s.num_waiting, s.block_usage, s.slot_usage)
            self.set_engine_settings(pool, replica, s.settings)

    def include(self, collectors: Sequence[Collector]) -> None:
        """Export collectors measured elsewhere in this process too (a colocated engine's)."""
        for collector in collectors:
            self.registry.register(collector)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)


class LegacyNames(Collector):
    """The families of `collectors` once more under their LEGACY_NAMES, without the `engine` label and with
    `finish_reason` for vLLM's `finished_reason`, collected from the same values at every scrape."""

    def __init__(self, collectors: Iterable[MetricWrapperBase]) -> None:
        self.collectors = list(collectors)

    def collect(self):
        for collector in self.collectors:
            for family in collector.collect():
                old = LEGACY_NAMES[family.name]
                out = Metric(old, family.documentation, family.type)
                for sample in family.samples:
                    labels = {("finish_reason" if k == "finished_reason" else k): value
                              for k, value in sample.labels.items() if k != "engine"}
                    out.add_sample(old + sample.name[len(family.name):], labels, sample.value)
                yield out

    def describe(self):
        return []  # registered without a fixed description, as the families it copies are checked there


@dataclass
class _ChoiceClock:
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0


class RequestTimer:
    """One request's clock, over its choices (one engine request each: `n` samples of each prompt of a batch; one
    by default). TTFT: to the first token of any choice (what the client waits for); ITL: between consecutive
    token-bearing deltas of one choice; TPOT: the choices' time from first to last token over their tokens after
    the first; decode time, prompt and generation tokens: per choice. Prompt tokens count each prompt once and
    generated tokens every choice's, as the usage does; the prefix cache counts every choice's lookup (its
    engine request's), from the cached tokens of its first delta. `finish` / `fail` count the request once;
    later calls do nothing."""

    def __init__(self, metrics: IngressMetrics, clock=time.perf_counter) -> None:
        self.metrics = metrics
        self.clock = clock
        self.arrival = clock()
        self.first_token_time: float | None = None
        self._choices: dict[int, _ChoiceClock] = {}
        self._prompt_tokens: dict[int, int] = {}  # prompt index -> its tokens
        self.done = False

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self._prompt_tokens.values())

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self._choices.values())

    def on_delta(self, num_new_tokens: int, num_prompt_tokens: int, num_output_tokens: int, *,
                 choice: int = 0, prompt: int = 0, num_cached_tokens: int = 0) -> None:
        """A delta of `choice`, a sample of `prompt`, arrived with that prompt's tokens, the choice's output
        tokens so far and its prefix-cache hit; one that carries tokens times TTFT (the request's first) or ITL
        (the choice's others)."""
        clock = self._choices.get(choice)
        m, labels = self.metrics, self.metrics.vllm_labels
        if clock is None:  # not setdefault: that builds a clock every delta
            clock = self._choices[choice] = _ChoiceClock()
            m.count_prefix_cache(num_prompt_tokens, num_cached_tokens)
        self._prompt_tokens[prompt], clock.num_output_tokens = num_prompt_tokens, num_output_tokens
        clock.num_prompt_tokens = num_prompt_tokens
        if num_new_tokens <= 0:
            return
        now = self.clock()
        if self.first_token_time is None:
            self.first_token_time = now
            m.ttft.labels(*labels).observe(now - self.arrival)
            m.status.observe("ttft", now - self.arrival)
        if clock.last_token_time is None:
            clock.first_token_time = now
        else:
            m.itl.labels(*labels).observe(now - clock.last_token_time)
        clock.last_token_time = now

    def finish(self, finish_reason: str) -> None:
        if self.done:
            return
        self.done = True
        m, labels = self.metrics, self.metrics.vllm_labels
        end = self.clock()
        m.e2e.labels(*labels).observe(end - self.arrival)
        timed = [c for c in self._choices.values() if c.first_token_time is not None]
        decode_tokens = sum(max(c.num_output_tokens - 1, 0) for c in timed)
        if decode_tokens > 0:
            decode_time = sum(c.last_token_time - c.first_token_time for c in timed)
            m.tpot.labels(*labels).observe(decode_time / decode_tokens)
            m.status.observe("tpot", decode_time / decode_tokens)
        for c in timed:
            m.decode_time.labels(*labels).observe(c.last_token_time - c.first_token_time)
        for c in self._choices.values():
            m.request_prompt_tokens.labels(*labels).observe(c.num_prompt_tokens)
            m.request_generation_tokens.labels(*labels).observe(c.num_output_tokens)
        if self._choices:
            m.max_generation_tokens.labels(*labels).observe(max(c.num_output_tokens for c in self._choices.values()))
        m.success.labels(*labels, finish_reason).inc()
        self._count_tokens()

    def fail(self, status: int) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.count_error(status)
        self._count_tokens()

    def _count_tokens(self) -> None:
        labels = self.metrics.vllm_labels
        self.metrics.prompt_tokens.labels(*labels).inc(self.num_prompt_tokens)
        self.metrics.generation_tokens.labels(*labels).inc(self.num_output_tokens)
