"""deploy/configs: `k3serve serve --config` files use only the serve flags (dashes as underscores),
with values of the right kind, and the tiny config names a preset k3serve ships."""

from __future__ import annotations

import pytest
import yaml

from _deploy import CONFIG_KEYS, DEPLOY

CONFIGS = sorted((DEPLOY / "configs").glob("*.yaml"))
INTS = ("prefill_replicas", "decode_replicas", "prefill_tp", "decode_tp", "block_size",
        "max_num_batched_tokens", "max_model_len", "max_num_seqs", "port")


def test_config_files():
    assert [p.name for p in CONFIGS] == ["k3-gb300.yaml", "tiny-cpu.yaml"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_keys_and_values(path):
    cfg = yaml.safe_load(path.read_text())
    assert set(cfg) == CONFIG_KEYS, f"missing {CONFIG_KEYS - set(cfg)}, unknown {set(cfg) - CONFIG_KEYS}"
    assert cfg["mode"] in ("disaggregated", "colocated")
    assert cfg["transfer"] in ("mooncake", "nixl", "local")
    for key in INTS:
        assert isinstance(cfg[key], int) and cfg[key] >= 1, key
    assert cfg["max_num_batched_tokens"] <= cfg["max_model_len"]
    assert isinstance(cfg["host"], str) and isinstance(cfg["served_model_name"], str)


def test_tiny_config_names_a_shipped_preset():
    from k3serve.model.presets import PRESETS

    cfg = yaml.safe_load((DEPLOY / "configs" / "tiny-cpu.yaml").read_text())
    assert cfg["model"] in PRESETS
    assert cfg["host"] == "127.0.0.1"  # a laptop or CI run listens on loopback only
