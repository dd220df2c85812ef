"""What tests/deploy share: where the tools are, the metric list, and PromQL checks.

Tools come from scripts/install_deploy_tools.sh (helm in .tools/bin, promtool from Debian, the
Python ones in the venv). A missing tool skips its test on a developer machine and fails it in CI
(CI=true), so CI cannot go green without running them.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
METRICS_FILE = DEPLOY / "metrics.txt"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Labels Prometheus adds to every scraped series.
SCRAPE_LABELS = frozenset({"job", "instance"})
# Series that Prometheus itself makes (allowed in rules, never on dashboards).
PROMETHEUS_SERIES = {"up": SCRAPE_LABELS}
# Keys every deploy config sets (`k3serve serve --config`: the long flags, dashes as underscores).
CONFIG_KEYS = frozenset({
    "model", "mode", "transfer", "prefill_replicas", "decode_replicas", "prefill_tp", "decode_tp",
    "block_size", "max_num_batched_tokens", "max_model_len", "max_num_seqs", "host", "port",
    "served_model_name", "device",
})


def serve_config_class():
    """k3serve's own config model (cluster/config.py), which `k3serve serve --config` loads."""
    need_module("pydantic")
    from k3serve.cluster.config import ServeConfig  # noqa: PLC0415

    return ServeConfig


def config_problems(cfg: dict) -> list[str]:
    """Why `k3serve serve` would refuse this config, by its own ServeConfig ([] = accepted)."""
    import pydantic

    try:
        serve_config_class()(**cfg)
    except pydantic.ValidationError as e:
        return [f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors()]
    return []


def missing(reason: str):
    """Skip locally, fail in CI: a deploy check that did not run must not look green there."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: run scripts/install_deploy_tools.sh in .ci/run)")
    pytest.skip(reason)


def need_tool(name: str) -> str:
    local = REPO / ".tools" / "bin" / name
    if local.is_file():
        return str(local)
    found = shutil.which(name)
    if found is None:
        missing(f"{name} not found: run scripts/install_deploy_tools.sh")
    return found


def need_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"Python module {name} not installed: run scripts/install_deploy_tools.sh")


@dataclass(frozen=True)
class Metric:
    name: str  # as written in PromQL (counters with _total; histograms by base name)
    type: str  # counter | gauge | histogram
    labels: frozenset[str]


def load_metrics() -> dict[str, Metric]:
    metrics = {}
    for n, line in enumerate(METRICS_FILE.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        assert len(fields) == 3, f"metrics.txt:{n}: want NAME TYPE LABELS, got {line!r}"
        name, kind, labels = fields
        assert kind in ("counter", "gauge", "histogram"), f"metrics.txt:{n}: unknown type {kind!r}"
        assert name not in metrics, f"metrics.txt:{n}: {name} listed twice"
        metrics[name] = Metric(name, kind, frozenset(labels.split(",")))
    return metrics


def exported_series(metrics: dict[str, Metric]) -> dict[str, frozenset[str]]:
    """Every series name a server exporting `metrics` serves, with its labels."""
    series = {}
    for m in metrics.values():
        if m.type == "histogram":
            series[m.name + "_bucket"] = m.labels | {"le"}
            series[m.name + "_sum"] = m.labels
            series[m.name + "_count"] = m.labels
        else:
            series[m.name] = m.labels
    return series


# Grafana's macros, replaced by a duration so the expression parses as PromQL.
_MACROS = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}")


def grafana_to_promql(expr: str) -> str:
    return _MACROS.sub("5m", expr)


def parse(expr: str):
    promql_parser = need_module("promql_parser")
    return promql_parser.parse(expr)


def _walk(node, visit) -> None:
    import promql_parser

    promql_parser.walk(node, pre_visit=lambda n: visit(n) or True)


def selectors(tree) -> list:
    import promql_parser

    found = []
    _walk(tree, lambda n: found.append(n) if isinstance(n, promql_parser.VectorSelector) else None)
    return found


def selector_name(sel) -> str | None:
    if sel.name:
        return sel.name
    for m in sel.matchers.matchers:
        if m.name == "__name__":
            return m.value
    return None


def check_expr(expr: str, known: dict[str, frozenset[str]]) -> list[str]:
    """Problems with one PromQL expression: a metric not in `known` (series name -> labels), a
    matcher or a `by (...)` label that the selected series do not carry."""
    import promql_parser

    tree = parse(expr)
    problems = []
    for sel in selectors(tree):
        name = selector_name(sel)
        if name not in known:
            problems.append(f"unknown metric {name!r}")
            continue
        allowed = known[name] | SCRAPE_LABELS
        for m in sel.matchers.matchers:
            if m.name != "__name__" and m.name not in allowed:
                problems.append(f"{name} has no label {m.name!r}")

    def check_by(node):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            if node.modifier.type == promql_parser.AggModifierType.By:
                inner = [known.get(selector_name(s), frozenset()) for s in selectors(node.expr)]
                allowed = frozenset().union(*inner) | SCRAPE_LABELS
                for label in node.modifier.labels:
                    if label not in allowed:
                        problems.append(f"by ({label}) over series without that label: {str(node)[:80]}")

    _walk(tree, check_by)
    return problems
