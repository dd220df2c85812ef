"""vLLM's published Grafana dashboard works against k3serve: every query of it (tests/data/vllm_grafana_queries.txt)
parses and names only series deploy/metrics.txt lists, with the labels it matches and groups by. (The live /metrics
of a served request is checked by tests/cluster/test_vllm_metrics.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from _deploy import check_expr, exported_series, grafana_to_promql, load_metrics

QUERIES = Path(__file__).resolve().parents[1] / "data" / "vllm_grafana_queries.txt"


def queries() -> list[str]:
    return [line for line in QUERIES.read_text().splitlines() if line and not line.startswith("#")]


@pytest.mark.parametrize("expr", queries())
def test_vllms_dashboard_query_names_series_k3serve_exports(expr):
    pytest.importorskip("promql_parser")
    assert check_expr(grafana_to_promql(expr.replace('"$model_name"', '"k3"')), exported_series(load_metrics())) == []
