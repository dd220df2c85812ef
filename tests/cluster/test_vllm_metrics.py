"""/metrics under vLLM's names: every vLLM family the tools read, with vLLM's labels, on a real engine behind the
app; vLLM's own dashboard's series; the prefix cache's hits as usage.prompt_tokens_details.cached_tokens; the pod
gauges the Gateway API Inference Extension reads; the legacy k3serve: names behind their switch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from k3serve.cluster.metrics import IngressMetrics, ReplicaLoad, pod_gauges

pytestmark = pytest.mark.anyio

DASHBOARD = Path(__file__).resolve().parents[1] / "data" / "vllm_grafana_queries.txt"
VLLM = {"model_name", "engine"}  # vllm/v1/metrics/loggers.py: every family's labelnames
# The families issue 26 names, as the exposition's family names (a counter without _total), with vLLM's labels.
VLLM_FAMILIES = {
    "vllm:time_to_first_token_seconds": VLLM,
    "vllm:inter_token_latency_seconds": VLLM,
    "vllm:e2e_request_latency_seconds": VLLM,
    "vllm:request_time_per_output_token_seconds": VLLM,
    "vllm:num_requests_running": VLLM,
    "vllm:num_requests_waiting": VLLM,
    "vllm:kv_cache_usage_perc": VLLM,
    "vllm:prefix_cache_queries": VLLM,
    "vllm:prefix_cache_hits": VLLM,
    "vllm:prompt_tokens": VLLM,
    "vllm:generation_tokens": VLLM,
    "vllm:request_success": VLLM | {"finished_reason"},
    "vllm:cache_config_info": {"engine", "block_size", "enable_prefix_caching", "num_gpu_blocks"},
}
LONG_PROMPT = [(7 * i) % 500 + 1 for i in range(40)]  # 2 full blocks of 16 before its last token


@pytest.fixture
def metrics(client, engine) -> IngressMetrics:
    """As a colocated deployment's (cluster/serve.py): the engine's stats read at every scrape."""
    metrics = IngressMetrics(CollectorRegistry(), model_name=client.model_name, max_model_len=client.max_model_len)
    metrics.watch_engine("colocated", "0", lambda: engine.call(lambda e: e.stats()))
    return metrics


def families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


async def test_every_vllm_family_is_on_metrics_with_vllms_labels(http, client):
    await http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 3, "temperature": 0.0})
    found = families((await http.get("/metrics")).text)
    for name, labels in VLLM_FAMILIES.items():
        assert found.get(name), f"{name} is not on /metrics"
        for sample in found[name]:
            assert labels <= set(sample.labels), f"{sample.name}: labels {sorted(sample.labels)}, want {sorted(labels)}"
    (config,) = found["vllm:cache_config_info"]
    assert config.labels["engine"] == "colocated-0" and config.labels["block_size"] == "16" and config.value == 1
    (success,) = [s for s in found["vllm:request_success"] if s.name.endswith("_total")]
    assert (success.labels["finished_reason"], success.labels["engine"], success.value) == ("length", "0", 1)


async def test_vllms_own_dashboard_finds_every_series_it_queries(http):
    """tests/data/vllm_grafana_queries.txt: the PromQL of vLLM's published dashboard."""
    await http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 3, "temperature": 0.0})
    exported = {s.name for samples in families((await http.get("/metrics")).text).values() for s in samples}
    queries = [line for line in DASHBOARD.read_text().splitlines() if line and not line.startswith("#")]
    used = {name for q in queries for name in re.findall(r"vllm:[a-z0-9_]+", q)}
    assert len(queries) >= 30 and len(used) >= 14
    assert not used - exported, f"queried by vLLM's dashboard, not exported: {sorted(used - exported)}"


async def test_a_prefix_cache_hit_is_the_usages_cached_tokens_and_counted(http, metrics):
    body = {"prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0.0}
    first = (await http.post("/v1/completions", json=body)).json()
    again = (await http.post("/v1/completions", json=body)).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}  # the checkpoint after 2 blocks
    assert again["usage"]["prompt_tokens"] == 40
    labels = {"model_name": metrics.model_name, "engine": "0"}
    assert metrics.registry.get_sample_value("vllm:prefix_cache_queries_total", labels) == 80
    assert metrics.registry.get_sample_value("vllm:prefix_cache_hits_total", labels) == 32


async def test_a_streamed_chats_usage_carries_cached_tokens(http):
    messages = [{"role": "user", "content": " ".join(["cached prefix words"] * 12)}]
    body = {"messages": messages, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    await http.post("/v1/chat/completions", json=body)
    text = (await http.post("/v1/chat/completions", json=body)).text
    usage = [line for line in text.splitlines() if '"usage":{' in line][-1]
    cached = int(re.search(r'"cached_tokens":(\d+)', usage).group(1))
    assert cached > 0 and cached % 16 == 0


# ---- the pod's gauges: what the Gateway API Inference Extension reads (deploy/README.md) ----------------------------
def test_the_pods_gauges_total_its_replicas_and_take_the_fullest_pools_kv_usage():
    loads = {("prefill", "0"): ReplicaLoad(2, 5, 0.5), ("prefill", "1"): ReplicaLoad(1, 1, 0.3),
             ("decode", "0"): ReplicaLoad(7, 0, 0.2)}
    running, waiting, usage = pod_gauges(loads, ingress_waiting=4)
    assert (running, waiting) == (10, 10) and usage == pytest.approx(0.4)
    assert pod_gauges({}, 0) == (0, 0, 0.0)


def test_gie_reads_one_series_a_pod_of_each_gauge():
    """GIE's model-server protocol: the queue depth (vllm:num_requests_waiting) and the KV utilisation
    (vllm:kv_cache_usage_perc) as one gauge each per pod, which it scrapes by name."""
    metrics = IngressMetrics(model_name="m", pools=[("prefill", "0"), ("decode", "0"), ("decode", "1")])
    metrics.set_pool_stats("prefill", "0", 3, 2, 0.25, 0.5)
    metrics.set_pool_stats("decode", "0", 8, 1, 0.5, 0.5)
    metrics.set_pool_stats("decode", "1", 4, 0, 0.7, 0.5)
    metrics.set_ingress_queue(6)
    found = families(metrics.render().decode())
    gie = {name: found[name] for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                                          "vllm:num_requests_running")}
    assert {name: [(s.labels, s.value) for s in samples] for name, samples in gie.items()} == {
        "vllm:num_requests_waiting": [({"model_name": "m", "engine": "0"}, 9.0)],
        "vllm:kv_cache_usage_perc": [({"model_name": "m", "engine": "0"}, pytest.approx(0.6))],
        "vllm:num_requests_running": [({"model_name": "m", "engine": "0"}, 15.0)],
    }
    metrics.remove_replica("decode", "1")
    assert metrics.registry.get_sample_value("vllm:kv_cache_usage_perc", {"model_name": "m", "engine": "0"}) == 0.5


# ---- the switch for the old names ----------------------------------------------------------------------------------
def test_legacy_names_export_the_renamed_families_with_their_old_labels_too():
    metrics = IngressMetrics(model_name="m", legacy_names=True)
    timer = metrics.start_request()
    timer.on_delta(1, 5, 1)
    timer.on_delta(1, 5, 2)
    timer.finish("stop")
    text = metrics.render().decode()
    assert 'k3serve:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
    assert 'k3serve:time_per_output_token_seconds_count{model_name="m"} 1.0' in text
    assert 'k3serve:request_success_total{finish_reason="stop",model_name="m"} 1.0' in text
    assert 'k3serve:generation_tokens_total{model_name="m"} 2.0' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0' in text
    assert "k3serve:time_to_first_token_seconds" not in IngressMetrics(model_name="m").render().decode()
