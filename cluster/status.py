"""`k3serve status`: ask a running server for its health, model, per-pool usage and engine settings."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

_GAUGES = ("k3serve:num_requests_running", "k3serve:num_requests_waiting", "k3serve:kv_block_usage_ratio",
           "k3serve:kda_slot_usage_ratio", "k3serve:replica_stats_stale", "k3serve:replicas_healthy",
           "k3serve:desired_replicas", "k3serve:current_replicas", "k3serve:autoscaling_signal",
           "k3serve:engine_config_info")  # the last: each engine's settings


def _get(url: str, api_key: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def print_status(base_url: str, api_key: str | None = None) -> int:
    """Print the status; exit code 0 if healthy, 1 if unhealthy, 2 if unreachable. `api_key`: the server's, which
    /v1/models needs when it has one (a refusal is shown, the rest of the status still printed)."""
    base = base_url.rstrip("/")
    try:
        health, health_body = _get(f"{base}/health")
        models_status, models = _get(f"{base}/v1/models", api_key)
        _, metrics = _get(f"{base}/metrics")
    except OSError as e:
        print(f"{base}: unreachable ({e})")
        return 2
    names = [m["id"] for m in json.loads(models or b"{}").get("data", [])]
    if models_status == 401:
        names = ["? (401: give the server's key: --api-key or $K3SERVE_API_KEY)"]
    state = "healthy" if health == 200 else _unhealthy(health, health_body)
    print(f"{base}: {state}; models: {', '.join(names) or '-'}")
    for line in metrics.decode().splitlines():
        if line.startswith(_GAUGES):
            print(f"  {line}")
    return 0 if health == 200 else 1


def _unhealthy(status: int, body: bytes) -> str:
    """/health's refusal with its reason ("unhealthy (503: degraded: no decode replica can admit ...)")."""
    try:
        reason = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"unhealthy ({status})"
    return f"unhealthy ({status}: {reason})"
