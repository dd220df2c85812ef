"""deploy/ray: every cluster YAML passes Ray's own `prepare_config` + `validate_config` (what
`ray up` runs first; offline for the local provider and for AWS before any API call), broken
copies fail, and the start commands keep every fixed port out of Ray's worker range."""

from __future__ import annotations

import copy
import re
import subprocess

import pytest
import yaml

from _deploy import DEPLOY, need_module

RAY_DIR = DEPLOY / "ray"
CLUSTERS = sorted(RAY_DIR.glob("*.yaml"))
WORKER_PORTS = range(10002, 20000)  # Ray's default min/max-worker-port
GPUS_PER_TRAY = 4


def ray_util():
    need_module("ray")
    from ray.autoscaler._private import util  # noqa: PLC0415 - Ray is optional for the other tests

    return util


def load(path):
    return yaml.safe_load(path.read_text())


def validated(config: dict) -> dict:
    util = ray_util()
    prepared = util.prepare_config(copy.deepcopy(config))
    util.validate_config(prepared)
    return prepared


def start_commands(config: dict) -> list[str]:
    return config["head_start_ray_commands"] + config["worker_start_ray_commands"]


def env_file(config: dict) -> dict[str, str]:
    """The KEY=VALUE file the start commands source."""
    names = {m for cmd in start_commands(config) for m in re.findall(r"~/k3serve/(deploy/ray/\S+\.env)", cmd)}
    assert len(names) == 1, f"start commands should source one env file, found {names}"
    lines = (DEPLOY.parent / names.pop()).read_text().splitlines()
    pairs = [line.split("=", 1) for line in lines if line.strip() and not line.startswith("#")]
    assert all(len(p) == 2 and re.fullmatch(r"[A-Z_][A-Z0-9_]*", p[0]) for p in pairs), pairs
    return dict(pairs)


def test_cluster_files():
    assert [p.name for p in CLUSTERS] == ["aws-example.yaml", "gb300-rack.yaml"]


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.stem)
def test_ray_accepts(path):
    prepared = validated(load(path))
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.stem)
@pytest.mark.parametrize("breakage", ["misspelt-key", "wrong-type", "misspelt-auth-key", "non-string-command"])
def test_ray_rejects_broken_copy(path, breakage):
    import jsonschema

    config = load(path)
    if breakage == "misspelt-key":
        config["head_start_ray_command"] = config.pop("head_start_ray_commands")
    elif breakage == "wrong-type":
        config["idle_timeout_minutes"] = "soon"
    elif breakage == "misspelt-auth-key":
        config["auth"]["ssh_private_kye"] = config["auth"].pop("ssh_private_key", "~/.ssh/id_ed25519")
    else:
        config["setup_commands"].append({"pip": "install k3serve"})
    with pytest.raises(jsonschema.ValidationError):
        validated(config)


def test_local_provider_without_workers_is_rejected():
    import click

    config = load(RAY_DIR / "gb300-rack.yaml")
    del config["provider"]["worker_ips"]
    with pytest.raises(click.ClickException, match="worker_ips"):
        validated(config)


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.stem)
def test_ports_avoid_ray_worker_range(path):
    config = load(path)
    for cmd in start_commands(config):
        if "ray start" not in cmd:
            continue
        assert "--min-worker-port=10002" in cmd and "--max-worker-port=19999" in cmd, cmd
        for flag, port in re.findall(r"--([a-z-]+port)=(\d+)", cmd):
            if flag not in ("min-worker-port", "max-worker-port"):
                assert int(port) not in WORKER_PORTS, f"--{flag}={port} lies in Ray's worker range"
    env = env_file(config)
    for lo, hi in (("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"), ("MC_MIN_PRC_PORT", "MC_MAX_PRC_PORT")):
        span = range(int(env[lo]), int(env[hi]) + 1)
        assert not set(span) & set(WORKER_PORTS), f"{lo}..{hi} overlaps Ray's worker range"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["RAY_AUTH_MODE"] == "token"


def test_rack_fits_the_k3_config():
    rack = load(RAY_DIR / "gb300-rack.yaml")
    cfg = load(DEPLOY / "configs" / "k3-gb300.yaml")
    trays = 1 + len(rack["provider"]["worker_ips"])
    assert rack["min_workers"] == rack["max_workers"] == trays - 1
    for cmd in start_commands(rack):
        if "ray start" in cmd:
            assert f"--num-gpus={GPUS_PER_TRAY}" in cmd
    need = cfg["prefill_replicas"] * cfg["prefill_tp"] + cfg["decode_replicas"] * cfg["decode_tp"]
    assert need == trays * GPUS_PER_TRAY, f"config needs {need} GPUs, the rack has {trays * GPUS_PER_TRAY}"
    for tp in (cfg["prefill_tp"], cfg["decode_tp"]):
        assert tp % GPUS_PER_TRAY == 0, "a TP group must fill whole trays"


def test_aws_pools_have_their_own_resource():
    nodes = load(RAY_DIR / "aws-example.yaml")["available_node_types"]
    assert nodes["prefill"]["resources"]["k3serve_prefill"] == nodes["prefill"]["resources"]["GPU"]
    assert nodes["decode"]["resources"]["k3serve_decode"] == nodes["decode"]["resources"]["GPU"]


def test_serve_script_parses():
    run = subprocess.run(["bash", "-n", str(RAY_DIR / "serve.sh")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
