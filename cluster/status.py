"""`k3serve status`: ask a running server for its health, model and per-pool usage."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

_GAUGES = ("k3serve:num_requests_running", "k3serve:num_requests_waiting", "k3serve:kv_block_usage_ratio",
           "k3serve:kda_slot_usage_ratio")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def print_status(base_url: str) -> int:
    """Print the status; exit code 0 if healthy, 1 if unhealthy, 2 if unreachable."""
    base = base_url.rstrip("/")
    try:
        health, _ = _get(f"{base}/health")
        _, models = _get(f"{base}/v1/models")
        _, metrics = _get(f"{base}/metrics")
    except OSError as e:
        print(f"{base}: unreachable ({e})")
        return 2
    names = [m["id"] for m in json.loads(models or b"{}").get("data", [])]
    print(f"{base}: {'healthy' if health == 200 else f'unhealthy ({health})'}; models: {', '.join(names) or '-'}")
    for line in metrics.decode().splitlines():
        if line.startswith(_GAUGES):
            print(f"  {line}")
    return 0 if health == 200 else 1
