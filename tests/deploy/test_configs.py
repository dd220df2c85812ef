"""deploy/configs: each `k3serve serve --config` file sets the serve flags the deployment needs
and is accepted by k3serve's own ServeConfig (what `k3serve serve --config FILE` loads)."""

from __future__ import annotations

import pytest
import yaml

from _deploy import CONFIG_KEYS, DEPLOY, config_problems

CONFIGS = sorted((DEPLOY / "configs").glob("*.yaml"))


def test_config_files():
    assert [p.name for p in CONFIGS] == ["k3-gb300.yaml", "tiny-cpu.yaml"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_sets_every_deployment_key(path):
    cfg = yaml.safe_load(path.read_text())
    assert CONFIG_KEYS <= set(cfg), f"missing {sorted(CONFIG_KEYS - set(cfg))}"
    need = cfg["prefill_replicas"] * cfg["prefill_tp"] + cfg["decode_replicas"] * cfg["decode_tp"]
    assert need >= 2 and cfg["max_num_batched_tokens"] <= cfg["max_model_len"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_k3serve_accepts(path):
    problems = config_problems(yaml.safe_load(path.read_text()))  # incl. the GB300 rack's decode TP8
    assert not problems, problems


def test_tiny_config_serves_the_shipped_model_on_loopback():
    from k3serve.model.packaged import DEFAULT_MODEL, packaged_model_dir

    cfg = yaml.safe_load((DEPLOY / "configs" / "tiny-cpu.yaml").read_text())
    assert cfg["model"] == DEFAULT_MODEL and packaged_model_dir(cfg["model"]) is not None and cfg["device"] == "cpu"
    assert cfg["host"] == "127.0.0.1"


def test_rack_config_joins_the_ray_cluster_on_gpus():
    cfg = yaml.safe_load((DEPLOY / "configs" / "k3-gb300.yaml").read_text())
    assert cfg["ray_address"] == "auto" and cfg["device"] == "cuda"


def test_rack_config_queues_one_round_of_decode():
    """K3's minute-long requests free about one round of decode slots per queue timeout (k3-gb300.yaml)."""
    cfg = yaml.safe_load((DEPLOY / "configs" / "k3-gb300.yaml").read_text())
    assert cfg["max_queued_requests"] == cfg["decode_replicas"] * cfg["max_num_seqs"]
    assert cfg["queue_timeout_seconds"] == 60
