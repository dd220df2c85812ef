"""`k3serve status`: ask a running server for its health, model, and a table of its pools' replicas.

One GET each of /health, /v1/models and /metrics. A replica's row: its health (its last stats call to the router),
requests running and waiting, KV block and KDA slot usage, its engine settings (`k3serve:engine_config_info`);
the ingress's admission queue is a row of its own. Below the table TTFT, TPOT and the handoff time, p50 and p90
over the last minute (`cluster/status_metrics.py`: the window is computed by the server, so one scrape suffices).
`--json` prints the same `ServerStatus` as JSON (NaN as null) for scripts. Exit code 0 healthy, 1 unhealthy,
2 unreachable (one line on stderr).
"""

from __future__ import annotations

import json
import math
import sys
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from k3serve.cluster.metrics import ENGINE_SETTINGS

_SETTING_NAMES = {"max_num_seqs": "seqs", "max_num_batched_tokens": "batch tokens", "enable_prefix_caching": "prefix",
                  "kda_checkpoint_mode": "kda ckpt", "num_gpu_blocks": "blocks", "num_kda_slots": "slots",
                  "block_size": "block", "cuda_graphs": "graphs", "speculative_config": "spec"}
_LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "handoff": "handoff"}


@dataclass
class ReplicaStatus:
    pool: str  # prefill, decode, colocated; "ingress" for the disaggregated admission queue
    replica: str
    healthy: bool | None  # None: not reported (a colocated engine, the ingress queue)
    running: int | None
    waiting: int
    kv_block_usage: float | None  # fraction
    kda_slot_usage: float | None
    settings: dict[str, str] = field(default_factory=dict)  # engine_config_info's labels
    stale: bool = False  # its last stats refresh failed: the other figures are gone until it answers
    acceptance_length: float | None = None  # speculative decoding's mean tokens a verify step (None: not speculating)


@dataclass
class LatencyStatus:
    metric: str  # ttft, tpot, handoff
    p50_seconds: float | None  # None: nothing observed in the window
    p90_seconds: float | None
    count: int  # observations in the window


@dataclass
class PoolScaling:
    pool: str  # an autoscaled pool (cluster/autoscaling.py)
    desired: int  # replicas the autoscaler wants
    current: int  # serving, starting or draining
    signal: str | None  # what it scales on, e.g. running_sequences
    value: float | None  # the signal's value now


@dataclass
class ServerStatus:
    url: str
    healthy: bool
    health_status: int  # /health's HTTP status
    health_reason: str | None  # why /health refused (e.g. "degraded: no decode replica can admit ..."), else None
    models: list[str]  # "?" when /v1/models refused (401: the key)
    replicas: list[ReplicaStatus]
    latency: list[LatencyStatus]
    latency_window_seconds: float = 60.0
    autoscaling: list[PoolScaling] = field(default_factory=list)


class Unreachable(OSError):
    """The server did not answer (refused, timed out, name not resolved)."""


def _get(url: str, api_key: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise Unreachable(getattr(e, "reason", e)) from e


def fetch_status(base_url: str, api_key: str | None = None) -> ServerStatus:
    """The server's status; raises Unreachable when it does not answer. `api_key`: the server's, which
    /v1/models needs when it has one (without it the models show as "?")."""
    base = base_url.rstrip("/")
    health, health_body = _get(f"{base}/health")
    models_status, models = _get(f"{base}/v1/models", api_key)
    _, metrics = _get(f"{base}/metrics")
    names = ["?"] if models_status == 401 else [m["id"] for m in json.loads(models or b"{}").get("data", [])]
    text = metrics.decode()
    replicas, latency = _parse_metrics(text)
    return ServerStatus(base, health == 200, health, _refusal_reason(health, health_body), names, replicas, latency,
                        autoscaling=_parse_autoscaling(text))


def _refusal_reason(status: int, body: bytes) -> str | None:
    """/health's error message when it refused (an OpenAI-style error body), else None."""
    if status == 200:
        return None
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None


def _parse_metrics(text: str) -> tuple[list[ReplicaStatus], list[LatencyStatus]]:
    """The replicas (in pool order: prefill, decode, colocated, ingress) and the last minute's latencies."""
    per_replica: dict[tuple[str, str], dict] = {}
    quantiles: dict[tuple[str, str], float] = {}
    counts: dict[str, int] = {}
    fields_of = {"k3serve:num_requests_running": "running", "k3serve:num_requests_waiting": "waiting",
                 "k3serve:kv_block_usage_ratio": "kv_block_usage", "k3serve:kda_slot_usage_ratio": "kda_slot_usage",
                 "k3serve:replica_healthy": "healthy", "k3serve:replica_stats_stale": "stale",
                 "k3serve:spec_decode_mean_acceptance_length": "acceptance_length"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels, value = sample.labels, sample.value
            if sample.name in fields_of and "pool" in labels:
                row = per_replica.setdefault((labels["pool"], labels["replica"]), {})
                row[fields_of[sample.name]] = value
            elif sample.name == "k3serve:engine_config_info" and "pool" in labels:
                row = per_replica.setdefault((labels["pool"], labels["replica"]), {})
                row["settings"] = {name: labels.get(name, "") for name in ENGINE_SETTINGS}
            elif sample.name == "k3serve:latency_last_minute_seconds":
                quantiles[(labels["metric"], labels["quantile"])] = value
            elif sample.name == "k3serve:latency_last_minute_requests":
                counts[labels["metric"]] = int(value)
    order = {"prefill": 0, "decode": 1, "colocated": 2, "ingress": 3}
    replicas = [
        ReplicaStatus(pool, replica, None if "healthy" not in row else row["healthy"] == 1.0,
                      _int(row.get("running")), _int(row.get("waiting")) or 0, row.get("kv_block_usage"),
                      row.get("kda_slot_usage"), row.get("settings", {}), row.get("stale") == 1.0,
                      row.get("acceptance_length"))
        for (pool, replica), row in sorted(per_replica.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1]))
    ]
    for replica in replicas:
        if replica.pool == "ingress":  # the admission queue has a waiting count alone
            replica.running = replica.kv_block_usage = replica.kda_slot_usage = None
    latency = [LatencyStatus(m, _finite(quantiles.get((m, "0.5"))), _finite(quantiles.get((m, "0.9"))),
                             counts.get(m, 0)) for m in _LATENCY_NAMES if m in counts]
    return replicas, latency


def _parse_autoscaling(text: str) -> list[PoolScaling]:
    """Each autoscaled pool's desired and current replicas and its signal (the autoscaler's gauges)."""
    pools: dict[str, dict] = {}
    names = {"k3serve:desired_replicas": "desired", "k3serve:current_replicas": "current"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                pools.setdefault(sample.labels["pool"], {})[names[sample.name]] = int(sample.value)
            elif sample.name == "k3serve:autoscaling_signal":
                pools.setdefault(sample.labels["pool"], {}).update(signal=sample.labels["signal"], value=sample.value)
    return [PoolScaling(pool, row.get("desired", 0), row.get("current", 0), row.get("signal"), row.get("value"))
            for pool, row in sorted(pools.items())]


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _finite(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def render_table(status: ServerStatus) -> str:
    """The status as text: a header line, one line a replica, one a latency."""
    models = ", ".join(status.models) or "-"
    if status.models == ["?"]:
        models = "? (401: give the server's key: --api-key or $K3SERVE_API_KEY)"
    reason = f": {status.health_reason}" if status.health_reason else ""
    health = "healthy" if status.healthy else f"unhealthy (/health {status.health_status}{reason})"
    lines = [f"{status.url}: {health}; models: {models}"]
    rows = [("POOL", "REPLICA", "HEALTHY", "RUNNING", "WAITING", "KV BLOCKS", "KDA SLOTS", "ACCEPT", "ENGINE")]
    for r in status.replicas:
        healthy = {True: "yes", False: "NO", None: "-"}[r.healthy] + (" (stale)" if r.stale else "")
        rows.append((r.pool, r.replica, healthy, _or_dash(r.running),
                     str(r.waiting), _percent(r.kv_block_usage), _percent(r.kda_slot_usage),
                     "-" if r.acceptance_length is None else f"{r.acceptance_length:.2f}", _settings(r.settings)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    if status.latency:
        lines.append(f"latency over the last {status.latency_window_seconds:g} s, at the ingress:")
        for lat in status.latency:
            lines.append(f"  {_LATENCY_NAMES[lat.metric]:<8} p50 {_ms(lat.p50_seconds):>9}  p90 {_ms(lat.p90_seconds):>9}"
                         f"  ({lat.count} observed)")
    for scale in status.autoscaling:
        signal = "" if scale.signal is None else f" ({scale.signal} {scale.value:g})"
        lines.append(f"autoscaling {scale.pool}: wants {scale.desired}, runs {scale.current}{signal}")
    return "\n".join(line.rstrip() for line in lines)


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}%"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def _settings(settings: dict[str, str]) -> str:
    return ", ".join(f"{_SETTING_NAMES.get(k, k)} {v}" for k, v in settings.items() if v) or "-"


def print_status(base_url: str, api_key: str | None = None, as_json: bool = False) -> int:
    """Print the status (a table, or JSON); exit code 0 if healthy, 1 if unhealthy, 2 if unreachable."""
    try:
        status = fetch_status(base_url, api_key)
    except Unreachable as e:
        print(f"k3serve status: cannot reach {base_url.rstrip('/')} ({e}): is `k3serve serve` running there? "
              "(--url names another server)", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(asdict(status), indent=2))
    else:
        print(render_table(status))
    return 0 if status.healthy else 1
