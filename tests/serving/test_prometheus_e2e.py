"""A real Prometheus (Debian package) scrapes a running disaggregated server; TTFT and TPOT
quantiles come back through PromQL, and every metric the deploy files use is really exported."""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from _local_ranks import free_port
from _server_harness import Server

REPO = Path(__file__).resolve().parents[2]


def _listed_metrics() -> set[str]:
    """Metric names of deploy/metrics.txt (what dashboards and rules use)."""
    names = set()
    for line in (REPO / "deploy" / "metrics.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            names.add(line.split()[0])
    return names


def _exported(server: Server) -> set[str]:
    """Families the server declares (a labelled counter with no series yet has only # TYPE)."""
    names = set()
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    return names


def _traffic(server: Server, n: int = 6) -> None:
    for i in range(n):
        resp = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": server.model, "prompt": f"note {i} about the weather", "max_tokens": 12, "ignore_eos": True})
        assert resp.status_code == 200, resp.text


@pytest.mark.timeout(180)
def test_every_listed_metric_is_exported_by_a_running_server(disagg_server: Server) -> None:
    _traffic(disagg_server, 2)
    time.sleep(1.0)  # the router refreshes replica stats and worker metrics every 0.25 s
    missing = sorted(_listed_metrics() - _exported(disagg_server))
    assert not missing, f"deploy/metrics.txt names metrics the server does not export: {missing}"


@pytest.mark.timeout(180)
def test_prometheus_scrapes_ttft_and_tpot_quantiles(disagg_server: Server) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed (scripts/install_deploy_tools.sh installs it)")
    port = free_port()
    target = disagg_server.url.removeprefix("http://")
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"scrape_configs: [{{job_name: k3serve, static_configs: [{{targets: ['{target}']}}]}}]\n"
        )
        prom = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={d}/data",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            api = f"http://127.0.0.1:{port}/api/v1/query"
            deadline = time.monotonic() + 60
            values: dict[str, float] = {}
            queries = {
                "ttft_p50": "histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[1m])))",
                "tpot_p50": "histogram_quantile(0.5, sum by (le) (rate(vllm:request_time_per_output_token_seconds_bucket[1m])))",
            }
            while time.monotonic() < deadline and len(values) < len(queries):
                _traffic(disagg_server, 2)
                time.sleep(1.5)
                for key, query in queries.items():
                    try:
                        result = httpx.get(api, params={"query": query}, timeout=5).json()["data"]["result"]
                    except (httpx.HTTPError, KeyError, ValueError):
                        continue  # Prometheus still starting
                    if result and not math.isnan(float(result[0]["value"][1])):
                        values[key] = float(result[0]["value"][1])
            assert set(values) == set(queries), f"quantiles not readable through PromQL: {values}"
            assert all(0 < v < 60 for v in values.values()), values
        finally:
            prom.terminate()
            prom.wait(10)
