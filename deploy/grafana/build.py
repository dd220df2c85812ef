"""Build the k3serve Grafana dashboards (committed beside this file as JSON).

    python deploy/grafana/build.py            # rewrite k3serve-overview.json and k3serve-pools.json
    python deploy/grafana/build.py --check    # exit 1 if a committed JSON differs from what this builds

Built with grafana-foundation-sdk (pinned `==1769699379!11.6.0` in scripts/install_deploy_tools.sh;
the default resolves to an old release). Every query names only metrics listed in deploy/metrics.txt
(checked by tests/deploy/test_grafana.py), so the dashboards never depend on recording rules:
they work against any Prometheus that scrapes `k3serve serve`'s GET /metrics.

Two dashboards:
    k3serve-overview   what clients see: TTFT / TPOT / ITL / E2E quantiles, TTFT breakdown,
                       request and token rates, tokens per request, prefix-cache hits, errors, structured outputs
    k3serve-pools      what the pools do: the pod's load as a gateway reads it (vllm: gauges), running / waiting
                       requests and KV-block / KDA-slot usage
                       per pool and replica, each replica's engine settings, healthy replicas, the ingress's queue
                       time, autoscaling, P->D handoff and transfer
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef, VariableRefresh

HERE = Path(__file__).resolve().parent
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
MODEL = 'model_name=~"$model_name"'
POOL = 'model_name=~"$model_name", pool=~"$pool"'
QUANTILES = (0.5, 0.9, 0.99)


class Layout:
    """Hands out panel ids in order, so the JSON is stable and every id is unique."""

    def __init__(self) -> None:
        self.next_id = 1

    def id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)


def quantile_queries(metric: str, selector: str = MODEL, by: str = "model_name") -> list[prometheus.Dataquery]:
    """p50 / p90 / p99 of a histogram over the dashboard's rate interval."""
    return [
        query(
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"p{round(q * 100)} {{{{{by}}}}}",
            "ABC"[i],
        )
        for i, q in enumerate(QUANTILES)
    ]


def series(
    ids: Layout, title: str, description: str, unit: str, targets: list[prometheus.Dataquery],
    width: int = 12, stacked: bool = False, max_val: float | None = None,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .id(ids.id())
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .min(0)
        .span(width)
        .height(8)
        .fill_opacity(10)
        .legend(cb.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST).placement(common.LegendPlacement.BOTTOM).show_legend(True))
        .tooltip(cb.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING))
        .targets(targets)
    )
    if stacked:
        panel = panel.stacking(cb.StackingConfig().mode(common.StackingMode.NORMAL))
    if max_val is not None:
        panel = panel.max(max_val)
    return panel


def headline(ids: Layout, title: str, description: str, unit: str, expr: str, legend: str) -> stat.Panel:
    return (
        stat.Panel()
        .id(ids.id())
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(6)
        .height(4)
        .graph_mode(common.BigValueGraphMode.AREA)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(query(expr, legend, "A"))
    )


def base(uid: str, title: str, description: str, extra_variables: list) -> dashboard.Dashboard:
    board = (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["k3serve"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("model_name")
            .label("Model")
            .datasource(DS)
            .query("label_values(vllm:request_success_total, model_name)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    )
    for variable in extra_variables:
        board = board.with_variable(variable)
    return board


def overview() -> dashboard.Dashboard:
    ids = Layout()
    board = base(
        "k3serve-overview",
        "k3serve / Overview",
        "What clients see: latency measured at the ingress (TTFT covers queue, prefill, handoff and the "
        "first decode step), request and token rates, errors.",
        [],
    )
    ok = f"sum by (model_name) (rate(vllm:request_success_total{{{MODEL}}}[{RATE}]))"
    # Labelled counters appear only after their first error: `or ok * 0` reads a missing series as 0.
    err = f"(sum by (model_name) (rate(k3serve:request_errors_total{{{MODEL}}}[{RATE}])) or {ok} * 0)"
    board = (
        board.with_row(dashboard.Row("Service").id(ids.id()))
        .with_panel(headline(ids, "Requests / s", "Finished requests per second (successes and errors).", "reqps",
                             f"{ok} + {err}", "{{model_name}}"))
        .with_panel(headline(ids, "Error ratio", "Errors over all finished requests.", "percentunit",
                             f"{err} / ({ok} + {err})", "{{model_name}}"))
        .with_panel(headline(ids, "Generated tokens / s", "Output tokens per second.", "short",
                             f"sum by (model_name) (rate(vllm:generation_tokens_total{{{MODEL}}}[{RATE}]))",
                             "{{model_name}}"))
        .with_panel(headline(ids, "Healthy replicas", "Replicas that can take requests, per pool.", "short",
                             f"sum by (pool) (k3serve:replicas_healthy{{{MODEL}}})", "{{pool}}"))
        .with_row(dashboard.Row("Latency (measured at the ingress)").id(ids.id()))
        .with_panel(series(ids, "Time to first token", "Request arrival to first streamed token: queue, prefill, "
                           "P->D handoff and the first decode step. SLO alert: 99% under 2.5 s.", "s",
                           quantile_queries("vllm:time_to_first_token_seconds")))
        .with_panel(series(ids, "Time per output token", "(E2E - TTFT) / (output tokens - 1) per request. "
                           "SLO alert: 99% under 0.1 s.", "s",
                           quantile_queries("vllm:request_time_per_output_token_seconds")))
        .with_panel(series(ids, "Inter-token latency", "Gap between consecutive streamed tokens (decode pool "
                           "step time as clients see it).", "s",
                           quantile_queries("vllm:inter_token_latency_seconds")))
        .with_panel(series(ids, "End-to-end latency", "Request arrival to last token.", "s",
                           quantile_queries("vllm:e2e_request_latency_seconds")))
        .with_panel(series(ids, "TTFT breakdown (p90)", "Where time to first token goes: waiting at the ingress "
                           "for room on a decode replica (the admission queue), prefill compute, and the P->D "
                           "handoff (transfer plus decode admission).", "s", [
                               query(f"histogram_quantile(0.9, sum by (le, model_name) (rate({m}_bucket{{{MODEL}}}[{RATE}])))",
                                     f"{name} {{{{model_name}}}}", "ABC"[i])
                               for i, (name, m) in enumerate([
                                   ("queue", "vllm:request_queue_time_seconds"),
                                   ("prefill", "vllm:request_prefill_time_seconds"),
                                   ("handoff", "k3serve:handoff_time_seconds"),
                               ])
                           ], width=24))
        .with_row(dashboard.Row("Throughput and errors").id(ids.id()))
        .with_panel(series(ids, "Tokens / s", "Prompt tokens prefilled and output tokens generated per second.",
                           "short", [
                               query(f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{MODEL}}}[{RATE}]))",
                                     "prompt {{model_name}}", "A"),
                               query(f"sum by (model_name) (rate(vllm:generation_tokens_total{{{MODEL}}}[{RATE}]))",
                                     "generation {{model_name}}", "B"),
                           ]))
        .with_panel(series(ids, "Finished requests / s by finish reason", "stop, length, abort, ...", "reqps", [
            query(f"sum by (model_name, finished_reason) (rate(vllm:request_success_total{{{MODEL}}}[{RATE}]))",
                  "{{finished_reason}} {{model_name}}", "A"),
        ], stacked=True))
        .with_panel(series(ids, "Errors / s by status", "Failed requests by HTTP status.", "reqps", [
            query(f"sum by (model_name, status) (rate(k3serve:request_errors_total{{{MODEL}}}[{RATE}]))",
                  "{{status}} {{model_name}}", "A"),
        ], stacked=True))
        .with_panel(series(ids, "Error ratio", "Errors over all finished requests.", "percentunit", [
            query(f"{err} / ({ok} + {err})", "{{model_name}}", "A"),
        ], max_val=1))
        .with_panel(series(ids, "Tokens per request", "Prompt and generated tokens of each choice (p50, p90), and "
                           "the most any choice of a request generated (p90).", "short", [
                               query(f"histogram_quantile({q}, sum by (le, model_name) (rate({m}_bucket{{{MODEL}}}[{RATE}])))",
                                     f"{name} p{round(q * 100)} {{{{model_name}}}}", ref)
                               for ref, (name, m, q) in zip("ABCDE", [
                                   ("prompt", "vllm:request_prompt_tokens", 0.5),
                                   ("prompt", "vllm:request_prompt_tokens", 0.9),
                                   ("generated", "vllm:request_generation_tokens", 0.5),
                                   ("generated", "vllm:request_generation_tokens", 0.9),
                                   ("most of a request", "vllm:request_max_num_generation_tokens", 0.9),
                               ])
                           ]))
        .with_panel(series(ids, "Prefix-cache hit rate", "Prompt tokens served by a prefix-cache hit over prompt "
                           "tokens looked up (what usage.prompt_tokens_details.cached_tokens reports per request).",
                           "percentunit", [
                               query(f"sum by (model_name) (rate(vllm:prefix_cache_hits_total{{{MODEL}}}[{RATE}])) / "
                                     f"sum by (model_name) (rate(vllm:prefix_cache_queries_total{{{MODEL}}}[{RATE}]))",
                                     "{{model_name}}", "A"),
                           ], max_val=1))
        .with_panel(series(ids, "Offload tiers", "Prompt tokens looked up in and served from each offload tier of "
                           "the prefix cache (kv_offload host | mooncake), per second; loads that did not verify "
                           "(a miss, recomputed); bytes copied out and in (engine/offload/metrics.py).", "short", [
                               query(f"sum by (tier) (rate(vllm:external_prefix_cache_queries_total{{{MODEL}}}[{RATE}]))",
                                     "queried: {{tier}}", "A"),
                               query(f"sum by (tier) (rate(vllm:external_prefix_cache_hits_total{{{MODEL}}}[{RATE}]))",
                                     "hit: {{tier}}", "B"),
                               query(f"sum by (tier) (rate(k3serve:kv_offload_misses_total{{{MODEL}}}[{RATE}]))",
                                     "missed loads: {{tier}}", "C"),
                               query(f"sum by (tier, direction) (rate(k3serve:kv_offload_bytes_total{{{MODEL}}}[{RATE}]))",
                                     "bytes {{direction}}: {{tier}}", "D"),
                           ]))
        .with_panel(series(ids, "Decode time", "First to last token of each choice.", "s",
                           quantile_queries("vllm:request_decode_time_seconds"), width=24))
        .with_row(dashboard.Row("Structured outputs").id(ids.id()))
        .with_panel(series(ids, "Structured outputs", "Constrained requests per second by kind (tool_choice: a "
                           "forced tool choice), those refused (400) because their constraint does not compile, "
                           "and the engines' grammar compilations and cache hits (a request is compiled on each "
                           "engine that serves it: prefill and decode in P/D).", "reqps", [
                               query(f"sum by (model_name, kind) (rate(k3serve:structured_output_requests_total{{{MODEL}}}[{RATE}]))",
                                     "{{kind}}", "A"),
                               query(f"sum by (model_name, kind) (rate(k3serve:structured_output_refusals_total{{{MODEL}}}[{RATE}]))",
                                     "refused: {{kind}}", "B"),
                               query(f"sum by (model_name) (rate(k3serve:structured_output_compile_seconds_count{{{MODEL}}}[{RATE}]))",
                                     "engine compiles", "C"),
                               query(f"sum by (model_name) (rate(k3serve:structured_output_grammar_cache_hits_total{{{MODEL}}}[{RATE}]))",
                                     "engine cache hits", "D"),
                           ]))
        .with_panel(series(ids, "Grammar compile time", "Seconds an engine takes to compile a constraint it has "
                           "not cached (its first compile also builds the vocabulary). The request waits for it "
                           "before it enters the engine.", "s",
                           quantile_queries("k3serve:structured_output_compile_seconds")))
        .with_row(dashboard.Row("Speculative decoding").id(ids.id()))
        .with_panel(series(ids, "Spec decode tokens / s", "Verify rows (drafts checked in one step), draft tokens "
                           "proposed and accepted per second, and the accepted ones by draft position (vLLM's "
                           "vllm:spec_decode_* counters, measured on the decode engines).", "short", [
                               query(f"sum by (model_name) (rate(vllm:spec_decode_num_drafts_total{{{MODEL}}}[{RATE}]))",
                                     "verify rows", "A"),
                               query(f"sum by (model_name) (rate(vllm:spec_decode_num_draft_tokens_total{{{MODEL}}}[{RATE}]))",
                                     "draft tokens", "B"),
                               query(f"sum by (model_name) (rate(vllm:spec_decode_num_accepted_tokens_total{{{MODEL}}}[{RATE}]))",
                                     "accepted", "C"),
                               query(f"sum by (model_name, position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{{{MODEL}}}[{RATE}]))",
                                     "accepted at {{position}}", "D"),
                           ]))
        .with_panel(series(ids, "Acceptance length", "Tokens a verify row emits (accepted drafts + 1): quantiles "
                           "over the window, and each decode replica's mean since it started.", "short",
                           quantile_queries("k3serve:spec_decode_acceptance_length") + [
                               query(f"max by (pool, replica) (k3serve:spec_decode_mean_acceptance_length{{{MODEL}}})",
                                     "mean {{replica}}", "Z"),
                           ]))
    )
    return board


def pools() -> dashboard.Dashboard:
    ids = Layout()
    pool_var = (
        dashboard.QueryVariable("pool")
        .label("Pool")
        .datasource(DS)
        .query('label_values(k3serve:num_requests_waiting{model_name=~"$model_name"}, pool)')  # incl. "ingress"
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )
    board = base(
        "k3serve-pools",
        "k3serve / Pools",
        "What the prefill and decode pools do: load and cache usage per replica, healthy replicas, and the "
        "P->D handoff (MLA latent KV blocks plus KDA state slots).",
        [pool_var],
    )

    def per_replica(metric: str) -> list[prometheus.Dataquery]:
        return [query(f"sum by (pool, replica) ({metric}{{{POOL}}})", "{{pool}} {{replica}}", "A")]

    return (
        board.with_row(dashboard.Row("Load").id(ids.id()))
        .with_panel(series(ids, "Running requests", "Requests in the running batch, per pool and replica.",
                           "short", per_replica("k3serve:num_requests_running"), width=8))
        .with_panel(series(ids, "Waiting requests", "Requests queued for admission, per pool and replica; pool "
                           "ingress: the disaggregated ingress's admission queue, waiting for a decode replica with "
                           "room. A growing decode or ingress queue means decode lacks KV blocks or KDA slots.",
                           "short", per_replica("k3serve:num_requests_waiting"), width=8))
        .with_panel(series(ids, "Healthy replicas", "Replicas that can take requests, per pool (a decode replica "
                           "whose room unmoving reservations hold does not count); stale: replicas whose last stats "
                           "refresh failed, their per-replica series dropped.", "short", [
            query(f"sum by (pool) (k3serve:replicas_healthy{{{POOL}}})", "{{pool}}", "A"),
            query(f"sum by (pool) (k3serve:replica_stats_stale{{{POOL}}})", "{{pool}} stale", "B"),
        ], width=8))
        .with_panel(series(ids, "Ingress queue time", "Arrival to a decode reservation, or to leaving without "
                           "one (timed out, cancelled): the wait in the ingress's admission queue while every "
                           "decode replica is full (before the prefill). Alert: p95 over 10 s for 10 min; past "
                           "queue_timeout_seconds a request gets 503.", "s",
                           quantile_queries("vllm:request_queue_time_seconds"), width=24))
        .with_panel(series(ids, "Autoscaled replicas", "Per autoscaled pool: the replicas k3serve's controller wants "
                           "(its signal against the pool's target, after the scale-up / scale-down delays) and those "
                           "it runs (serving, starting or draining).", "short", [
            query(f"sum by (pool) (k3serve:desired_replicas{{{POOL}}})", "{{pool}} desired", "A"),
            query(f"sum by (pool) (k3serve:current_replicas{{{POOL}}})", "{{pool}} current", "B"),
        ]))
        .with_panel(series(ids, "Autoscaling signal", "What each autoscaled pool is sized on: its load summed over "
                           "its serving replicas (queued_prompt_tokens, running_sequences, a usage ratio's sum), or "
                           "an SLO signal's p90 in seconds (ttft_p90_seconds, tpot_p90_seconds).",
                           "short", [query(f"sum by (pool, signal) (k3serve:autoscaling_signal{{{POOL}}})",
                                           "{{pool}} {{signal}}", "A")]))
        .with_panel(series(ids, "Pod load (what a gateway reads)", "The ingress's pod totals under vLLM's names: "
                           "requests running on any replica, waiting on any replica or in the admission queue, and "
                           "the KV usage of the fullest pool (the Gateway API Inference Extension's queue and "
                           "KV-utilisation gauges).", "short", [
                               query(f"sum by (model_name) (vllm:num_requests_running{{{MODEL}}})", "running", "A"),
                               query(f"sum by (model_name) (vllm:num_requests_waiting{{{MODEL}}})", "waiting", "B"),
                               query(f"max by (model_name) (vllm:kv_cache_usage_perc{{{MODEL}}}) * 100",
                                     "KV usage %", "C"),
                           ], width=24))
        .with_row(dashboard.Row("Cache").id(ids.id()))
        .with_panel(series(ids, "KV block usage", "Share of paged MLA latent-KV blocks in use.", "percentunit",
                           per_replica("k3serve:kv_block_usage_ratio"), max_val=1))
        .with_panel(series(ids, "KDA slot usage", "Share of KDA recurrent + conv state slots in use (one per "
                           "running request, plus prefix checkpoints).", "percentunit",
                           per_replica("k3serve:kda_slot_usage_ratio"), max_val=1))
        .with_panel(series(ids, "Engine settings", "Each replica's engine as it runs (1 while it does; the settings "
                           "in the legend): per-pool --prefill-NAME / --decode-NAME values, and the blocks and slots "
                           "its pools were given.", "short", [
                               query(f"max by (pool, replica, max_num_seqs, num_gpu_blocks, num_kda_slots, "
                                     f"enable_prefix_caching) (k3serve:engine_config_info{{{POOL}}})",
                                     "{{pool}} {{replica}}: max_num_seqs {{max_num_seqs}}, {{num_gpu_blocks}} blocks, "
                                     "{{num_kda_slots}} KDA slots, prefix caching {{enable_prefix_caching}}", "A"),
                           ], width=24))
        .with_panel(series(ids, "Cache config", "vLLM's cache_config_info of each replica (engine: pool-replica).",
                           "short", [
                               query("max by (engine, block_size, num_gpu_blocks, enable_prefix_caching) "
                                     f"(vllm:cache_config_info{{{MODEL}}})",
                                     "{{engine}}: block {{block_size}}, {{num_gpu_blocks}} blocks, prefix caching "
                                     "{{enable_prefix_caching}}", "A"),
                           ], width=24))
        .with_row(dashboard.Row("Handoff and transfer").id(ids.id()))
        .with_panel(series(ids, "Handoff time", "Prefill finished to request running on a decode replica.",
                           "s", quantile_queries("k3serve:handoff_time_seconds")))
        .with_panel(series(ids, "Transfer time", "Posting a request's writes to the last rank's confirmation.",
                           "s", quantile_queries("k3serve:transfer_seconds")))
        .with_panel(series(ids, "Transfer bandwidth", "Bytes of MLA blocks and KDA slots landed per second.",
                           "Bps", [
                               query(f"sum by (model_name) (rate(k3serve:transfer_bytes_total{{{MODEL}}}[{RATE}]))",
                                     "{{model_name}}", "A"),
                           ]))
        .with_panel(series(ids, "Transfer problems / s", "Failed transfers by reason, checksum mismatches (landed "
                           "bytes differ: fail closed), pin leases that expired unconfirmed, handoffs retried into "
                           "a new reservation, streams migrated to another decode replica and adopted state found "
                           "changed behind the engine (integrity: the request failed).", "short", [
                               query(f"sum by (model_name, reason) (rate(k3serve:transfer_failures_total{{{MODEL}}}[{RATE}]))",
                                     "failed: {{reason}}", "A"),
                               query(f"sum by (model_name) (rate(k3serve:transfer_checksum_mismatches_total{{{MODEL}}}[{RATE}]))",
                                     "checksum mismatch", "B"),
                               query(f"sum by (model_name) (rate(k3serve:transfer_lease_expiries_total{{{MODEL}}}[{RATE}]))",
                                     "lease expired", "C"),
                               query(f"sum by (model_name) (rate(k3serve:handoff_retries_total{{{MODEL}}}[{RATE}]))",
                                     "handoff retried", "D"),
                               query(f"sum by (model_name) (rate(k3serve:request_migrations_total{{{MODEL}}}[{RATE}]))",
                                     "stream migrated", "E"),
                               query(f"sum by (model_name, stage) (rate(k3serve:transfer_integrity_failures_total{{{MODEL}}}[{RATE}]))",
                                     "integrity: {{stage}}", "F"),
                           ]))
        .with_panel(series(ids, "Pinned by in-flight transfers", "Decode-side KV blocks and KDA slots held by "
                           "transfers that have not been confirmed.", "short", [
                               query(f"sum by (model_name) (k3serve:transfer_pinned_blocks{{{MODEL}}})",
                                     "blocks {{model_name}}", "A"),
                               query(f"sum by (model_name) (k3serve:transfer_pinned_slots{{{MODEL}}})",
                                     "slots {{model_name}}", "B"),
                           ], width=24))
    )


DASHBOARDS = {"k3serve-overview.json": overview, "k3serve-pools.json": pools}


def render(build) -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed JSON, write nothing")
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: beside this script)")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        text = render(build)
        json.loads(text)  # the encoder's output must be JSON
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)}; run python deploy/grafana/build.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
