"""deploy/prometheus: promtool accepts the config and the rules, the rules' unit tests pass, and
every expression names only exported series (deploy/metrics.txt), series recorded by the rules
themselves, or Prometheus' own `up`."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from _deploy import DEPLOY, PROMETHEUS_SERIES, check_expr, exported_series, load_metrics, need_tool

PROM = DEPLOY / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yaml"))
TEST_FILES = sorted((PROM / "tests").glob("*.yaml"))
# Recording-rule names are level:metric:operations; the level names the labels the result keeps.
LEVELS = {"model_name": {"model_name"}, "model_name_le": {"model_name", "le"}, "model_name_pool": {"model_name", "pool"}}


def promtool(*args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([need_tool("promtool"), *args], capture_output=True, text=True, cwd=PROM, timeout=60)
    assert run.returncode == 0, f"promtool {' '.join(args)}:\n{run.stdout}\n{run.stderr}"
    return run


def rules() -> list[dict]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def test_check_config():
    out = promtool("check", "config", "prometheus.yml").stdout
    assert f"{len(RULE_FILES)} rule files found" in out


def test_check_rules():
    promtool("check", "rules", *[str(p.relative_to(PROM)) for p in RULE_FILES])


def test_rule_unit_tests():
    assert [p.name for p in TEST_FILES] == ["alerts_test.yaml", "recording_test.yaml"]
    out = promtool("test", "rules", *[str(p.relative_to(PROM)) for p in TEST_FILES]).stdout
    assert out.count("SUCCESS") == len(TEST_FILES)


def test_group_names_unique_across_files():
    # The Helm chart's PrometheusRule concatenates the files: one namespace for group names.
    names = [g["name"] for path in RULE_FILES for g in yaml.safe_load(path.read_text())["groups"]]
    assert len(names) == len(set(names)), names


def test_expressions_name_known_series():
    known = dict(exported_series(load_metrics())) | PROMETHEUS_SERIES
    for rule in rules():
        if "record" in rule:
            level = rule["record"].split(":")[0]
            assert level in LEVELS, f"{rule['record']}: level {level!r} is not one of {sorted(LEVELS)}"
            known[rule["record"]] = frozenset(LEVELS[level] | set(rule.get("labels", {})))
    problems = []
    for rule in rules():
        name = rule.get("record") or rule["alert"]
        problems += [f"{name}: {p}" for p in check_expr(rule["expr"], known)]
    assert not problems, "\n".join(problems)


def test_alerts_are_labelled_and_tested():
    alerts = [r for r in rules() if "alert" in r]
    assert len(alerts) >= 10
    tested = {t["alertname"] for case in yaml.safe_load((PROM / "tests" / "alerts_test.yaml").read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    for alert in alerts:
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
        assert {"summary", "description"} <= set(alert["annotations"]), alert["alert"]
        assert alert["alert"] in tested, f"{alert['alert']} has no promtool test in alerts_test.yaml"


@pytest.mark.parametrize("slo, le", [("ttft", "2.5"), ("tpot", "0.1")])
def test_slo_windows_cover_every_burn_rate_pair(slo, le):
    recorded = {r["record"]: r["expr"] for r in rules() if "record" in r}
    for window in ("5m", "30m", "1h", "2h", "6h", "1d"):
        expr = recorded[f"model_name:k3serve_{slo}_slo_miss:ratio_rate{window}"]
        assert f'le="{le}"' in expr and f"[{window}]" in expr
