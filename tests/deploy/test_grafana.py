"""deploy/grafana: the committed dashboards are what build.py makes, every query parses as PromQL
and names only series a running `k3serve serve` exports (deploy/metrics.txt), with labels those
series carry."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from _deploy import DEPLOY, check_expr, exported_series, grafana_to_promql, load_metrics, need_module

GRAFANA = DEPLOY / "grafana"
DASHBOARDS = sorted(GRAFANA.glob("*.json"))
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def panels(board: dict) -> list[dict]:
    out = []
    for panel in board.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def queries(board: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found = []
    for panel in panels(board):
        for target in panel.get("targets", []):
            found.append((f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]))
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = LABEL_VALUES.match(query)
        assert match, f"variable {var['name']}: only label_values(selector, label) queries are supported, got {query!r}"
        found.append((f"variable {var['name']}", match["selector"]))
    return found


def test_dashboards_exist():
    assert [p.name for p in DASHBOARDS] == ["k3serve-overview.json", "k3serve-pools.json"]


def test_committed_json_is_what_build_py_makes():
    need_module("grafana_foundation_sdk")
    run = subprocess.run([sys.executable, str(GRAFANA / "build.py"), "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_query_parses_and_names_exported_series(path):
    board = json.loads(path.read_text())
    known = exported_series(load_metrics())
    found = queries(board)
    assert len(found) >= 10
    problems = []
    for where, expr in found:
        try:
            problems += [f"{where}: {p}" for p in check_expr(grafana_to_promql(expr), known)]
        except ValueError as e:  # promql_parser's parse error
            problems.append(f"{where}: does not parse: {e}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_structure(path):
    board = json.loads(path.read_text())
    assert board["uid"] == path.stem
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids {ids}"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in panels(board):
        if panel["type"] == "row":
            continue
        assert panel.get("title") and panel.get("description"), f"panel {panel['id']} needs a title and description"
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"panel {panel['title']!r}: duplicate refIds"
        for target in panel["targets"]:
            assert 'model_name=~"$model_name"' in target["expr"], f"{panel['title']!r} ignores the model filter"


def test_every_listed_metric_is_on_a_dashboard():
    used = set()
    for path in DASHBOARDS:
        for _, expr in queries(json.loads(path.read_text())):
            used.update(re.findall(r"(?:k3serve|vllm):[a-z0-9_]+", expr))
    shown = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    assert set(load_metrics()) <= shown, f"not on any dashboard: {sorted(set(load_metrics()) - shown)}"


@pytest.mark.parametrize("expr, problem", [
    ("rate(k3serve:time_to_first_token_seconds[5m])", "unknown metric 'k3serve:time_to_first_token_seconds'"),
    ("k3serve:gpu_cache_usage_perc", "unknown metric"),
    ('k3serve:num_requests_running{engine="0"}', "no label 'engine'"),
    ("sum by (pool) (rate(k3serve:handoff_time_seconds_count[5m]))", "by (pool)"),
], ids=["histogram-without-suffix", "vllm-name", "unknown-label", "by-missing-label"])
def test_checker_rejects(expr, problem):
    problems = check_expr(expr, exported_series(load_metrics()))
    assert any(problem in p for p in problems), problems
