"""Prometheus metrics of the ingress, named `k3serve:*`, with vLLM's bucket layouts.

Latencies are measured here, at the ingress, not on a decode replica: on a replica TTFT would
start after the remote prefill and under-report (PD_PRIOR_ART.md section 4).

    arrival ──queue──> prefill ──handoff──> first token ... token ... last token
    |<────────────── TTFT ──────────────────>|<── ITL ──>|
    |<──────────────────────────── e2e ──────────────────────────────>|
    TPOT = (last token - first token) / (num_output_tokens - 1)

The app drives one `RequestTimer` per HTTP request (`start_request`, `on_delta`, `finish` / `fail`),
whatever its number of choices.
Queue, prefill and handoff times are only known to the serving layer, which reports them with
`observe_queue_time` and friends (the disaggregated router's queue time: arrival to a decode
reservation, which its prefill waits for, or to leaving its admission queue without one: timed out,
cancelled); it also sets the per-(pool, replica) gauges with
`set_pool_stats`, and with `set_ingress_queue` the requests its admission queue holds, as
`k3serve:num_requests_waiting{pool="ingress", replica="router"}` (on the pools dashboard and in
`k3serve status` beside the replicas' queues), and with `set_engine_settings` each replica's engine settings as
`k3serve:engine_config_info` (value 1, the settings in its labels, as vLLM's `cache_config_info`). Structured outputs: the app counts each request with a constraint
by its kind (`count_structured_output`: json, json_object, regex, choice, grammar, or tool_choice for a forced tool
choice) and, among them, those refused with a 400 because the constraint does not compile
(`count_structured_output_refusal`; request_errors counts them too, by status only); how long the engines take to
compile is measured on the engines (engine/structured_output_metrics.py), which a colocated deployment adds here
with `include`. Every series carries `model_name`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import Collector

# vLLM v1's layouts (vllm/v1/metrics/loggers.py; Ray Serve LLM copies them)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)

POOL_LABELS = ("model_name", "pool", "replica")
ENGINE_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "kda_checkpoint_mode",
                   "num_gpu_blocks", "num_kda_slots", "block_size", "cuda_graphs", "speculative_config")
"""`LLMEngine.settings`' names: the labels `k3serve:engine_config_info` carries beside POOL_LABELS."""


class IngressMetrics:
    """All ingress series in one registry (a fresh one unless `registry` is given)."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "",
                 pools: Sequence[tuple[str, str]] = ()) -> None:
        """pools: (pool, replica) pairs whose gauges start at 0, e.g. [("prefill", "0"), ("decode", "0")]."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        reg, m = self.registry, ("model_name",)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(f"k3serve:{name}", doc, m, buckets=buckets, registry=reg)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token, at the ingress.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive token-bearing deltas.", ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "(last - first token time) / (output tokens - 1) per request.",
                         ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token, at the ingress.", REQUEST_TIME_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time waiting before prefill started.",
                               REQUEST_TIME_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "Prefill time (on the prefill pool).",
                                 REQUEST_TIME_BUCKETS)
        self.handoff_time = hist("handoff_time_seconds", "KV + KDA state handoff from prefill to decode.",
                                 REQUEST_TIME_BUCKETS)
        self.success = Counter("k3serve:request_success", "Finished requests by finish reason.",
                               ("model_name", "finish_reason"), registry=reg)
        self.errors = Counter("k3serve:request_errors", "Requests answered with an error, by HTTP status "
                              "(499: the client went away; 503 includes requests cut by a drain's timeout).", ("model_name", "status"),
                              registry=reg)
        self.prompt_tokens = Counter("k3serve:prompt_tokens", "Prompt tokens of served requests.", m, registry=reg)
        self.generation_tokens = Counter("k3serve:generation_tokens", "Generated tokens.", m, registry=reg)
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
        self.replicas_healthy = Gauge("k3serve:replicas_healthy", "Replicas of a pool answering health checks.",
                                      ("model_name", "pool"), registry=reg)
        self.engine_config = Gauge("k3serve:engine_config_info", "1 for each replica's engine; its labels: the "
                                   "settings the engine runs with (blocks and slots as its pools were made).",
                                   POOL_LABELS + ENGINE_SETTINGS, registry=reg)
        self._engine_settings: dict[tuple[str, str], tuple[str, ...]] = {}  # (pool, replica) -> its labels now
        for series in (self.ttft, self.itl, self.tpot, self.e2e, self.queue_time, self.prefill_time,
                       self.handoff_time, self.prompt_tokens, self.generation_tokens):
            series.labels(model_name)  # exported from the start, at 0
        for pool, replica in pools:
            self.set_pool_stats(pool, replica, 0, 0, 0.0, 0.0)

    # ---- per request ------------------------------------------------------------------------
    def start_request(self) -> "RequestTimer":
        return RequestTimer(self)

    def count_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(int(status))).inc()

    def count_structured_output(self, kind: str) -> None:
        self.structured_outputs.labels(self.model_name, kind).inc()

    def count_structured_output_refusal(self, kind: str) -> None:
        self.structured_output_refusals.labels(self.model_name, kind).inc()

    # ---- reported by the serving layer ------------------------------------------------------
    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.labels(self.model_name).observe(seconds)

    def observe_prefill_time(self, seconds: float) -> None:
        self.prefill_time.labels(self.model_name).observe(seconds)

    def observe_handoff_time(self, seconds: float) -> None:
        self.handoff_time.labels(self.model_name).observe(seconds)

    def set_pool_stats(self, pool: str, replica: str, num_running: int, num_waiting: int,
                       kv_block_usage: float, kda_slot_usage: float,
                       spec_mean_acceptance_length: float | None = None) -> None:
        labels = (self.model_name, pool, str(replica))
        if spec_mean_acceptance_length is not None:
            self.spec_acceptance_length.labels(*labels).set(spec_mean_acceptance_length)
        self.running.labels(*labels).set(num_running)
        self.waiting.labels(*labels).set(num_waiting)
        self.kv_block_usage.labels(*labels).set(kv_block_usage)
        self.kda_slot_usage.labels(*labels).set(kda_slot_usage)

    def set_engine_settings(self, pool: str, replica: str, settings: dict[str, str]) -> None:
        """The replica's one `engine_config_info` series, replacing its previous one (a restarted replica's
        engine may have been given other pools)."""
        labels = (self.model_name, pool, str(replica), *(settings.get(name, "") for name in ENGINE_SETTINGS))
        previous = self._engine_settings.get((pool, str(replica)))
        if previous != labels:
            if previous is not None:
                self.engine_config.remove(*previous)
            self.engine_config.labels(*labels).set(1)
            self._engine_settings[(pool, str(replica))] = labels

    def set_ingress_queue(self, num_waiting: int) -> None:
        self.waiting.labels(self.model_name, "ingress", "router").set(num_waiting)

    def set_replicas_healthy(self, pool: str, num_healthy: int) -> None:
        self.replicas_healthy.labels(self.model_name, pool).set(num_healthy)

    def remove_replica(self, pool: str, replica: str) -> None:
        labels = (self.model_name, pool, str(replica))
        for gauge in (self.running, self.waiting, self.kv_block_usage, self.kda_slot_usage,
                      self.spec_acceptance_length):
            try:
                gauge.remove(*labels)
            except KeyError:
                pass
        settings = self._engine_settings.pop((pool, str(replica)), None)
        if settings is not None:
            self.engine_config.remove(*settings)

    def include(self, collectors: Sequence[Collector]) -> None:
        """Export collectors measured elsewhere in this process too (a colocated engine's)."""
        for collector in collectors:
            self.registry.register(collector)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)


@dataclass
class _ChoiceClock:
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0


class RequestTimer:
    """One request's clock, over its choices (one engine request each: `n` samples of each prompt of a batch; one
    by default). TTFT: to the first token of any choice (what the client waits for); ITL: between consecutive
    token-bearing deltas of one choice; TPOT: the choices' time from first to last token over their tokens after
    the first. Prompt tokens count each prompt once and generated tokens every choice's, as the usage does.
    `finish` / `fail` count the request once; later calls do nothing."""

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
                 choice: int = 0, prompt: int = 0) -> None:
        """A delta of `choice`, a sample of `prompt`, arrived with that prompt's tokens and the choice's output
        tokens so far; one that carries tokens times TTFT (the request's first) or ITL (the choice's others)."""
        clock = self._choices.get(choice)
        if clock is None:  # not setdefault: that builds a clock every delta
            clock = self._choices[choice] = _ChoiceClock()
        self._prompt_tokens[prompt], clock.num_output_tokens = num_prompt_tokens, num_output_tokens
        if num_new_tokens <= 0:
            return
        now, name = self.clock(), self.metrics.model_name
        if self.first_token_time is None:
            self.first_token_time = now
            self.metrics.ttft.labels(name).observe(now - self.arrival)
        if clock.last_token_time is None:
            clock.first_token_time = now
        else:
            self.metrics.itl.labels(name).observe(now - clock.last_token_time)
        clock.last_token_time = now

    def finish(self, finish_reason: str) -> None:
        if self.done:
            return
        self.done = True
        m, name = self.metrics, self.metrics.model_name
        end = self.clock()
        m.e2e.labels(name).observe(end - self.arrival)
        timed = [c for c in self._choices.values() if c.first_token_time is not None]
        decode_tokens = sum(max(c.num_output_tokens - 1, 0) for c in timed)
        if decode_tokens > 0:
            decode_time = sum(c.last_token_time - c.first_token_time for c in timed)
            m.tpot.labels(name).observe(decode_time / decode_tokens)
        m.success.labels(name, finish_reason).inc()
        self._count_tokens()

    def fail(self, status: int) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.count_error(status)
        self._count_tokens()

    def _count_tokens(self) -> None:
        name = self.metrics.model_name
        self.metrics.prompt_tokens.labels(name).inc(self.num_prompt_tokens)
        self.metrics.generation_tokens.labels(name).inc(self.num_output_tokens)
