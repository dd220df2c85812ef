"""deploy/helm/k3serve: `helm lint --strict`, then `helm template` of the default values and of
every deploy/helm/examples/*.yaml, each with and without the Prometheus Operator API, validated:

  core kinds       kubernetes-validate, strict (unknown fields fail), Kubernetes 1.31 and 1.37
  RayCluster       KubeRay v1.6.2's CRD schema (tests/deploy/schemas, vendored by vendor_crds.py),
                   closed like the strict core schemas; each group's pod `template` validated as
                   a core PodTemplate
  ServiceMonitor,  prometheus-operator v0.93.0's CRD schemas, closed; the PrometheusRule's groups
  PrometheusRule   must be deploy/prometheus/rules verbatim and pass `promtool check rules`

A kind with no schema fails the test: nothing rendered goes unchecked.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

from _deploy import CONFIG_KEYS, DEPLOY, config_problems, need_module, need_tool, serve_config_class

CHART = DEPLOY / "helm" / "k3serve"
EXAMPLES = sorted((DEPLOY / "helm" / "examples").glob("*.yaml"))
SCHEMAS = Path(__file__).resolve().parent / "schemas"
K8S_VERSIONS = ("1.31", "1.37")
MONITORING_API = "monitoring.coreos.com/v1"
CASES = [None, *EXAMPLES]


def case_id(case) -> str:
    return "default" if case is None else case.stem


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    run = subprocess.run([need_tool("helm"), *args], capture_output=True, text=True, timeout=60)
    if check:
        assert run.returncode == 0, f"helm {' '.join(args)}:\n{run.stdout}\n{run.stderr}"
    return run


@cache
def render(values: Path | None = None, monitoring: bool = False, sets: tuple[str, ...] = ()) -> tuple[dict, ...]:
    args = ["template", "k3", str(CHART), "--namespace", "llm"]
    if values is not None:
        args += ["-f", str(values)]
    if monitoring:
        args += ["--api-versions", MONITORING_API]
    for s in sets:
        args += ["--set", s]
    return tuple(doc for doc in yaml.safe_load_all(helm(*args).stdout) if doc)


def of_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@cache
def crd_validator(kind: str):
    import jsonschema

    vendored = json.loads((SCHEMAS / f"{kind.lower()}.json").read_text())
    schema = close(copy.deepcopy(vendored["schema"]))
    return vendored["apiVersion"], jsonschema.Draft7Validator(schema)


def close(node):
    """additionalProperties: false wherever an object lists its properties (the API server would
    prune an unknown field silently; `kubernetes-validate --strict` rejects it, and so do we)."""
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for value in node.values():
            close(value)
    elif isinstance(node, list):
        for value in node:
            close(value)
    return node


def validate_core(doc: dict) -> None:
    kv = need_module("kubernetes_validate")
    for version in K8S_VERSIONS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}) {path}: {e.message}") from None


def validate_crd(doc: dict) -> None:
    api_version, validator = crd_validator(doc["kind"])
    assert doc["apiVersion"] == api_version
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, f"{doc['kind']}/{doc['metadata']['name']}:\n" + "\n".join(errors)


def pod_templates(cluster: dict) -> list[tuple[str, dict]]:
    spec = cluster["spec"]
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    return [(name, g["template"]) for name, g in groups]


def validate(doc: dict, tmp_path: Path) -> None:
    kind = doc["kind"]
    if kind == "RayCluster":
        validate_crd(doc)
        for name, template in pod_templates(doc):
            validate_core({"apiVersion": "v1", "kind": "PodTemplate",
                           "metadata": {"name": f"{doc['metadata']['name']}-{name}"}, "template": template})
    elif kind in ("ServiceMonitor", "PrometheusRule"):
        validate_crd(doc)
        if kind == "PrometheusRule":
            check_rule_groups(doc, tmp_path)
    elif kind in ("ConfigMap", "Service", "Ingress", "NetworkPolicy", "HorizontalPodAutoscaler"):
        validate_core(doc)
    else:
        raise AssertionError(f"no schema to check kind {kind}: add one to tests/deploy/test_helm.py")


def check_rule_groups(doc: dict, tmp_path: Path) -> None:
    source = [g for p in sorted((DEPLOY / "prometheus" / "rules").glob("*.yaml")) for g in yaml.safe_load(p.read_text())["groups"]]
    assert doc["spec"]["groups"] == source, "PrometheusRule groups differ from deploy/prometheus/rules"
    rule_file = tmp_path / "prometheusrule.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))
    run = subprocess.run([need_tool("promtool"), "check", "rules", str(rule_file)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("values", CASES, ids=case_id)
def test_lint_strict(values):
    args = ["lint", "--strict", str(CHART)] + ([] if values is None else ["-f", str(values)])
    helm(*args)


@pytest.mark.parametrize("monitoring", [False, True], ids=["plain", "prometheus-operator"])
@pytest.mark.parametrize("values", CASES, ids=case_id)
def test_rendered_manifests_validate(values, monitoring, tmp_path):
    docs = render(values, monitoring)
    assert len(of_kind(docs, "RayCluster")) == 1
    for doc in docs:
        validate(doc, tmp_path)


def test_monitoring_objects_follow_the_api_or_the_toggle():
    kinds = lambda docs: sorted(d["kind"] for d in docs)  # noqa: E731
    assert "ServiceMonitor" not in kinds(render())
    assert {"ServiceMonitor", "PrometheusRule"} <= set(kinds(render(monitoring=True)))
    off = ("monitoring.serviceMonitor.enabled=false", "monitoring.prometheusRule.enabled=false")
    assert not {"ServiceMonitor", "PrometheusRule"} & set(kinds(render(monitoring=True, sets=off)))
    forced = ("monitoring.serviceMonitor.enabled=true", "monitoring.prometheusRule.enabled=true")
    assert {"ServiceMonitor", "PrometheusRule"} <= set(kinds(render(sets=forced)))


def test_config_file_is_one_k3serve_accepts():
    for values in CASES:
        (cm,) = [d for d in of_kind(render(values), "ConfigMap") if d["metadata"]["name"].endswith("-config")]
        cfg = yaml.safe_load(cm["data"]["config.yaml"])
        assert CONFIG_KEYS <= set(cfg), f"{case_id(values)}: missing {CONFIG_KEYS - set(cfg)}"
        assert cfg["host"] == "0.0.0.0" and cfg["ray_address"] == "auto"
        problems = config_problems(cfg)
        assert not problems, f"{case_id(values)}: {problems}"
    cfg = yaml.safe_load(of_kind(render(DEPLOY / "helm" / "examples" / "tiny-cpu.yaml"), "ConfigMap")[0]["data"]["config.yaml"])
    assert cfg["model"] == "k3-code" and cfg["transfer"] == "nixl" and cfg["device"] == "cpu"
    assert yaml.safe_load(of_kind(render(), "ConfigMap")[0]["data"]["config.yaml"])["device"] == "cuda"


def test_queue_bounds_reach_the_config_only_when_set():
    """Unset, k3serve's own defaults apply (8 rounds of the decode pool, 60 s); 0 is a value (never wait)."""
    config = lambda sets=(): yaml.safe_load(of_kind(render(sets=sets), "ConfigMap")[0]["data"]["config.yaml"])  # noqa: E731
    assert not {"max_queued_requests", "queue_timeout_seconds"} & set(config())
    cfg = config(("serving.maxQueuedRequests=0", "serving.queueTimeoutSeconds=90"))
    assert (cfg["max_queued_requests"], cfg["queue_timeout_seconds"]) == (0, 90)
    assert not config_problems(cfg)
    gb300 = yaml.safe_load(of_kind(render(DEPLOY / "helm" / "examples" / "gb300-mooncake.yaml"), "ConfigMap")[0]["data"]["config.yaml"])
    assert gb300["max_queued_requests"] == gb300["decode_replicas"] * gb300["max_num_seqs"]  # one round: see the example


def config_of(docs) -> dict:
    """The `k3serve serve --config` file a render carries."""
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    return yaml.safe_load(cm["data"]["config.yaml"])


def snake(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def test_the_engine_values_are_serve_configs_engine_arguments():
    """values.schema.json's engine.* keys are ServeConfig's engine arguments in camelCase (but those the chart sets
    from other values: model, served_model_name, device), <pool>.engine.* its per-pool ones: a knob k3serve
    gains must be added to the chart, and the chart cannot offer one k3serve lacks."""
    from k3serve.cluster.config import DECODE_ENGINE_ARGS, DEPLOYMENT_ENGINE_ARGS, POOL_ENGINE_ARGS

    definitions = json.loads((CHART / "values.schema.json").read_text())["definitions"]
    shared = set(DEPLOYMENT_ENGINE_ARGS + POOL_ENGINE_ARGS + DECODE_ENGINE_ARGS) - {"model", "served_model_name", "device"}
    assert {snake(k) for k in definitions["engineArgs"]["properties"]} == shared
    assert {snake(k) for k in definitions["poolEngineArgs"]["properties"]} == set(POOL_ENGINE_ARGS)


ENGINE_VALUES = """
engine:
  maxNumSeqs: 32
  gpuMemoryUtilization: 0.85
  enablePrefixCaching: true
  kdaCheckpointMode: align
  cudaGraphBatchSizes: [1, 2, 4, 8]
  decodeContextParallelSize: 8
  numKdaSlots: null
decode:
  engine:
    maxNumSeqs: 8
    enablePrefixCaching: false
    numGpuBlocksOverride: 4096
prefill:
  engine:
    maxNumBatchedTokens: 8192
    longPrefillTokenThreshold: 2048
"""


def test_engine_values_reach_each_pools_engine_arguments(tmp_path):
    values = tmp_path / "engine.yaml"
    values.write_text(ENGINE_VALUES)
    cfg = config_of(render(values))
    assert not config_problems(cfg), config_problems(cfg)
    assert "num_kda_slots" not in cfg  # null: k3serve's default
    from k3serve.cluster.config import ServeConfig

    config = ServeConfig(**cfg)
    prefill, decode = config.engine_args("prefill"), config.engine_args("decode")
    assert (prefill.max_num_seqs, prefill.enable_prefix_caching, prefill.max_num_batched_tokens) == (32, True, 8192)
    assert (prefill.long_prefill_token_threshold, prefill.kda_checkpoint_mode) == (2048, "align")
    assert (decode.max_num_seqs, decode.enable_prefix_caching, decode.num_gpu_blocks_override) == (8, False, 4096)
    assert decode.cuda_graph_batch_sizes == (1, 2, 4, 8) and prefill.enforce_eager  # graphs: decode's only
    assert (decode.decode_context_parallel_size, prefill.decode_context_parallel_size) == (8, 1)  # decode's only
    assert prefill.gpu_memory_utilization == decode.gpu_memory_utilization == 0.85
    assert decode.max_num_batched_tokens == 16384  # the chart's default, from engine.*


def test_head_runs_k3serve_behind_health():
    docs = render()
    (cluster,) = of_kind(docs, "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "exec k3serve serve --config /etc/k3serve/config.yaml" in head["args"][0]
    assert head["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "livenessProbe" not in head  # KubeRay's Ray health check: /health 503 must not restart the head
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    (service,) = of_kind(docs, "Service")
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert {"name": "http", "containerPort": 8000} in head["ports"]


def test_the_head_drains_within_its_grace_period():
    """SIGTERM comes after the preStop sleep (endpoints gone first); k3serve's drain then the workers' shutdown
    must fit in what is left of terminationGracePeriodSeconds, which follows the drain timeout."""
    def head_of(sets=()):
        docs = render(sets=sets)
        config = yaml.safe_load(of_kind(docs, "ConfigMap")[0]["data"]["config.yaml"])
        pod = of_kind(docs, "RayCluster")[0]["spec"]["headGroupSpec"]["template"]["spec"]
        return config, pod, pod["containers"][0]

    config, pod, head = head_of()
    assert config["drain_timeout_seconds"] == 30 and not config_problems(config)
    assert head["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert pod["terminationGracePeriodSeconds"] == 5 + 30 + 30
    config, pod, head = head_of(("serving.drainTimeoutSeconds=120", "head.preStopSleepSeconds=0"))
    assert config["drain_timeout_seconds"] == 120 and "lifecycle" not in head
    assert pod["terminationGracePeriodSeconds"] == 120 + 30


@pytest.mark.parametrize("values", CASES, ids=case_id)
def test_every_ray_container_gets_the_pod_ip_once_as_k3serve_host_ip(values):
    """The one variable cluster/node_address.py reads; no second copy of the pod IP to drift."""
    (cluster,) = of_kind(render(values), "RayCluster")
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for group in groups:
        env = group["template"]["spec"]["containers"][0]["env"]
        pod_ip = [e["name"] for e in env if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"]
        assert pod_ip == ["K3SERVE_HOST_IP"], pod_ip


def api_key_env(sets: tuple[str, ...] = ()) -> dict[str, list]:
    """Each Ray container's env entries named K3SERVE_API_KEY, by container name."""
    (cluster,) = of_kind(render(sets=sets), "RayCluster")
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    containers = [c for g in groups for c in g["template"]["spec"]["containers"]]
    return {c["name"]: [e for e in c["env"] if e["name"] == "K3SERVE_API_KEY"] for c in containers}


def test_the_api_key_reaches_the_head_from_its_secret_only_when_set():
    """The key never sits in values or the config; only `k3serve serve` (the head) reads it; the probe and the
    ServiceMonitor ask open routes."""
    assert not any(api_key_env().values())
    with_key = api_key_env(("auth.existingSecret=k3-api", "auth.secretKey=token"))
    assert with_key.pop("ray-head") == [
        {"name": "K3SERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "k3-api", "key": "token"}}}]
    assert not any(with_key.values())  # the pools' workers never see it
    docs = render(monitoring=True, sets=("auth.existingSecret=k3-api",))
    (cluster,) = of_kind(docs, "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["readinessProbe"]["httpGet"]["path"] == "/health"
    assert [e["path"] for e in of_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"]] == ["/metrics"]
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    assert "api_key" not in yaml.safe_load(cm["data"]["config.yaml"])


def worker_groups(values) -> dict[str, dict]:
    (cluster,) = of_kind(render(values), "RayCluster")
    return {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}


def test_gb300_pools_span_trays():
    groups = worker_groups(DEPLOY / "helm" / "examples" / "gb300-mooncake.yaml")
    for name in ("prefill", "decode"):
        g = groups[name]
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == 8  # 4 TP8 replicas x 2 trays
        assert g["resources"] == {f"k3serve_{name}": "4"}
        pod = g["template"]["spec"]
        limits = pod["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 4 and limits["rdma/ib"] == 1
        assert pod["containers"][0]["resources"]["claims"] == [{"name": "imex"}]
        assert pod["resourceClaims"][0]["resourceClaimTemplateName"] == "k3serve-compute-domain-channel"
        assert "IPC_LOCK" in pod["containers"][0]["securityContext"]["capabilities"]["add"]


def test_autoscaling_bounds_become_pod_bounds():
    groups = worker_groups(DEPLOY / "helm" / "examples" / "h200-nixl-hf.yaml")
    assert (groups["prefill"]["minReplicas"], groups["prefill"]["replicas"], groups["prefill"]["maxReplicas"]) == (1, 1, 3)
    assert (groups["decode"]["minReplicas"], groups["decode"]["replicas"], groups["decode"]["maxReplicas"]) == (1, 2, 3)
    (cluster,) = of_kind(render(DEPLOY / "helm" / "examples" / "h200-nixl-hf.yaml"), "RayCluster")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    init = cluster["spec"]["headGroupSpec"]["template"]["spec"]["initContainers"][0]
    assert init["command"][:2] == ["hf", "download"]


AUTOSCALED = {"autoscaling": {"enabled": True},
              "prefill": {"autoscaling": {"maxReplicas": 3}},
              "decode": {"autoscaling": {"signal": "kv_block_usage", "target": 0.8, "scaleDownDelaySeconds": 120}}}


def values_file(tmp_path: Path, values: dict) -> Path:
    """`values` as a -f file (`--set` would turn 0.8 into a string)."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_autoscaling_settings_reach_k3serves_controller_and_the_ray_autoscaler(tmp_path):
    docs = render(values_file(tmp_path, AUTOSCALED))
    config = config_of(docs)
    assert {k: v for k, v in config.items() if k.startswith("decode_") and k != "decode_tp"} == {
        "decode_replicas": 2, "decode_min_replicas": 1, "decode_max_replicas": 4,
        "decode_autoscale_signal": "kv_block_usage", "decode_autoscale_target": 0.8,
        "decode_scale_up_delay_seconds": 30, "decode_scale_down_delay_seconds": 120}
    assert config["prefill_max_replicas"] == 3 and config["prefill_autoscale_signal"] == "queued_prompt_tokens"
    assert not config_problems(config), config_problems(config)
    rule = serve_config_class()(**config).autoscaling("decode")
    assert (rule.signal, rule.target, rule.min_replicas, rule.max_replicas) == ("kv_block_usage", 0.8, 1, 4)
    (cluster,) = of_kind(docs, "RayCluster")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert (groups["decode"]["minReplicas"], groups["decode"]["maxReplicas"]) == (2, 8)  # TP8 over pods of 4 GPUs
    assert not any(k.startswith(("prefill_m", "decode_m", "prefill_auto", "decode_auto")) for k in config_of(render()))


def test_a_bad_autoscaling_value_is_one_k3serve_refuses_naming_the_field(tmp_path):
    bad = copy.deepcopy(AUTOSCALED)
    bad["decode"]["autoscaling"]["target"] = 1.5
    config = config_of(render(values_file(tmp_path, bad)))
    assert config_problems(config) == ["config: Value error, decode_autoscale_target=1.5: kv_block_usage is a ratio: "
                                       "give at most 1"]


HPA = ("autoscaling.hpa.enabled=true",
       "autoscaling.hpa.scaleTargetRef.prefill.apiVersion=apps/v1", "autoscaling.hpa.scaleTargetRef.prefill.kind=StatefulSet",
       "autoscaling.hpa.scaleTargetRef.prefill.name=k3-prefill",
       "autoscaling.hpa.scaleTargetRef.decode.apiVersion=apps/v1", "autoscaling.hpa.scaleTargetRef.decode.kind=StatefulSet",
       "autoscaling.hpa.scaleTargetRef.decode.name=k3-decode", "decode.autoscaling.scaleDownDelaySeconds=120")


def test_the_hpa_alternative_sizes_each_pool_on_its_prometheus_signal(tmp_path):
    docs = render(sets=HPA)
    hpas = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in of_kind(docs, "HorizontalPodAutoscaler")}
    assert set(hpas) == {"prefill", "decode"}
    for doc in hpas.values():
        validate(doc, tmp_path)
    decode = hpas["decode"]["spec"]
    assert decode["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "k3-decode"}
    assert (decode["minReplicas"], decode["maxReplicas"]) == (1, 4)
    (metric,) = decode["metrics"]
    assert metric["external"]["metric"] == {"name": "k3serve_autoscaling_signal",
                                            "selector": {"matchLabels": {"pool": "decode", "signal": "running_sequences"}}}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "96"}
    assert decode["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120
    assert not of_kind(render(), "HorizontalPodAutoscaler")
    (cluster,) = of_kind(docs, "RayCluster")
    assert cluster["spec"]["enableInTreeAutoscaling"] is False


def test_cpu_pools_ask_for_no_accelerator():
    for group in worker_groups(DEPLOY / "helm" / "examples" / "tiny-cpu.yaml").values():
        container = group["template"]["spec"]["containers"][0]
        assert set(container["resources"]["limits"]) == {"cpu", "memory"}
        assert "securityContext" not in container


def test_dashboards_configmap_carries_deploy_grafana():
    (cm,) = [d for d in of_kind(render(), "ConfigMap") if d["metadata"]["name"].endswith("-dashboards")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: json.loads(p.read_text()) for p in (DEPLOY / "grafana").glob("*.json")}
    assert {name: json.loads(text) for name, text in cm["data"].items()} == files


@pytest.mark.parametrize("sets, error", [
    (("serving.transfer=rdma",), "serving.transfer must be one of"),
    (("prefill.tp=6",), "spans pods of 4 GPUs unevenly"),
    (("decode.tp=3", "decode.gpusPerPod=4"), "does not divide gpusPerPod"),
    (("model.source=hf",), "model.hf.id is required"),
    (("unknownKey=1",), "Additional property unknownKey is not allowed"),
    (("serving.maxQueuedRequests=-1",), "serving.maxQueuedRequests: Must be greater than or equal to 0"),
    (("serving.queueTimeoutSeconds=0",), "serving.queueTimeoutSeconds: Must be greater than 0"),
    (("serving.drainTimeoutSeconds=-1",), "serving.drainTimeoutSeconds: Must be greater than or equal to 0"),
    (("serving.mode=colocated", "serving.maxQueuedRequests=4"), "unset it for serving.mode colocated"),
    (("auth.existingSecret=k3-api", "probes.readiness.path=/v1/models"), "needs the API key"),
    (("engine.maxNumSeq=8",), "engine: Additional property maxNumSeq is not allowed"),
    (("decode.engine.blockSize=32",), "decode.engine: Additional property blockSize is not allowed"),
    (("engine.kdaCheckpointMode=sometimes",), "engine.kdaCheckpointMode must be one of"),
    (("serving.mode=colocated", "decode.engine.maxNumSeqs=8"), "serving.mode colocated runs one engine"),
    (("autoscaling.enabled=true", "serving.mode=colocated"), "serving.mode colocated runs one engine"),
    (("prefill.autoscaling.signal=running_sequences",), "prefill.autoscaling.signal must be one of"),
    (("decode.autoscaling.minReplicas=0",), "decode.autoscaling.minReplicas: Must be greater than or equal to 1"),
    (("decode.autoscaling.target=0",), "decode.autoscaling.target: Must be greater than 0"),
    (("autoscaling.hpa.enabled=true",), "autoscaling.hpa.scaleTargetRef.prefill is required"),
    (("autoscaling.hpa.enabled=true", "autoscaling.enabled=true"), "choose one controller"),
], ids=["bad-transfer", "uneven-tp", "tp-not-dividing", "hf-without-id", "unknown-key", "negative-queue",
        "zero-queue-timeout", "negative-drain", "colocated-queue", "probe-behind-the-key", "unknown-engine-key",
        "shared-only-engine-key-per-pool", "bad-engine-choice", "colocated-pool-engine",
        "colocated-autoscaling", "prefill-decode-signal", "zero-min-replicas", "zero-target", "hpa-without-target",
        "two-controllers"])
def test_bad_values_are_rejected(sets, error):
    args = ["template", "k3", str(CHART)]
    for s in sets:
        args += ["--set", s]
    run = helm(*args, check=False)
    assert run.returncode != 0 and error in run.stderr, run.stderr


@pytest.mark.parametrize("where", ["raycluster", "pod-template", "servicemonitor", "service"])
def test_validation_rejects_a_misspelt_field(where, tmp_path):
    kind = {"raycluster": "RayCluster", "pod-template": "RayCluster", "servicemonitor": "ServiceMonitor",
            "service": "Service"}[where]
    (doc,) = copy.deepcopy(of_kind(render(monitoring=True), kind))
    if where == "raycluster":
        doc["spec"]["workerGroupSpecs"][0]["maxReplica"] = 4
    elif where == "pod-template":
        doc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    elif where == "servicemonitor":
        doc["spec"]["endpoints"][0]["scrapeInterval"] = "15s"
    else:
        doc["spec"]["ports"][0]["targetPorts"] = "http"
    with pytest.raises(AssertionError, match="Additional properties|additional properties"):
        validate(doc, tmp_path)


def test_the_network_policy_opens_the_cluster_to_itself_and_only_the_api_and_metrics_ports_outside():
    docs = render()
    (policy,) = of_kind(docs, "NetworkPolicy")
    (cluster,) = of_kind(docs, "RayCluster")
    (service,) = of_kind(docs, "Service")
    spec = policy["spec"]
    own = {"ray.io/cluster": cluster["metadata"]["name"]}
    assert spec["podSelector"] == {"matchLabels": own} and service["spec"]["selector"]["ray.io/cluster"] == own[
        "ray.io/cluster"]  # every pod of the RayCluster (KubeRay labels them), head and pools
    assert spec["policyTypes"] == ["Ingress"]
    inside, *outside = spec["ingress"]
    assert inside == {"from": [{"podSelector": {"matchLabels": own}}]}  # any port: Ray, Mooncake, UCX, gRPC
    assert [rule["ports"] for rule in outside] == [[{"port": 8000, "protocol": "TCP"}],
                                                   [{"port": 8080, "protocol": "TCP"}]]
    assert all("from" not in rule for rule in outside)  # default: those two ports from anywhere


def test_the_network_policy_narrows_the_api_to_the_peers_given_and_can_be_turned_off():
    peers = ("networkPolicy.apiFrom[0].namespaceSelector.matchLabels.team=llm-gateway",
             "networkPolicy.extraIngress[0].ports[0].port=8265")
    (policy,) = of_kind(render(sets=peers), "NetworkPolicy")
    api, metrics, extra = policy["spec"]["ingress"][1:]
    assert api["from"] == [{"namespaceSelector": {"matchLabels": {"team": "llm-gateway"}}}]
    assert "from" not in metrics and extra == {"ports": [{"port": 8265}]}
    assert of_kind(render(sets=("networkPolicy.enabled=false",)), "NetworkPolicy") == []


def test_the_chart_starts_mooncake_stores_master_and_points_the_offloading_engines_at_it():
    docs = render(sets=("mooncakeStore.enabled=true", "engine.kvOffload=mooncake", "mooncakeStore.args[0]=--v=1"))
    (deployment,) = [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-mooncake-master")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["mooncake_master"]
    assert "--enable_http_metadata_server=true" in container["args"] and "--v=1" in container["args"]
    (service,) = [d for d in of_kind(docs, "Service") if d["metadata"]["name"].endswith("-mooncake-master")]
    assert {p["port"] for p in service["spec"]["ports"]} == {50051, 8080}
    cfg = config_of(docs)
    store = json.loads(cfg["kv_offload_mooncake_config"])
    assert store["master_server_addr"] == f"{service['metadata']['name']}:50051"
    assert store["metadata_server"] == f"http://{service['metadata']['name']}:8080/metadata"
    from k3serve.cluster.config import ServeConfig

    assert ServeConfig(**cfg).engine_args("decode").kv_offload == "mooncake"  # a config k3serve accepts
    assert not [d for d in of_kind(render(), "Deployment") if d["metadata"]["name"].endswith("-mooncake-master")]
