"""What a default single-node deployment (Ray launcher, Mooncake, started here) listens on, read with `ss -ltnp`.

Spec:
- k3serve's own listener, each decode rank's DecodeControl gRPC server, is on loopback only, and every address
  the workers advertise (control addresses, Mooncake endpoints) is loopback;
- a request goes through: prefill's handshake and calls carry the secret the deployment made at its start;
- each worker process listens on nothing else off loopback but what k3serve cannot narrow, each named in
  deploy/README.md ("Network exposure") with the NetworkPolicy that covers it: Mooncake's RPC and TCP transfer
  ports and Ray's core-worker gRPC port; Ray's own processes (gcs_server, raylet, the dashboard and runtime env
  agents) are named there too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
ray = pytest.importorskip("ray")  # a test extra; the GPU machine has none

from k3serve.cluster.config import ServeConfig
from k3serve.cluster.serve import start_deployment
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.transfer.backends import available_backends

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
ENGINE = dict(block_size=16, max_model_len=512, cache_memory_bytes=64 << 20)
NOT_NARROWABLE = 3  # per worker process: Mooncake RPC, Mooncake TCP transfer, Ray core worker
_LISTEN = re.compile(r"^LISTEN\s+\d+\s+\d+\s+(\S+):(\d+)\s+\S+\s+users:\(\(\"[^\"]*\",pid=(\d+),")


def listeners() -> dict[int, list[tuple[str, int]]]:
    """pid -> [(address, port)] of every listening TCP socket on this host."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10, check=True).stdout
    found: dict[int, list[tuple[str, int]]] = {}
    for line in out.splitlines():
        match = _LISTEN.match(line.strip())
        if match:
            address, port, pid = match.groups()
            found.setdefault(int(pid), []).append((address.strip("[]").removeprefix("::ffff:"), int(port)))
    return found


def is_loopback(address: str) -> bool:
    return address not in ("*", "0.0.0.0", "::") and ipaddress.ip_address(address).is_loopback


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


async def generate(router) -> int:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    num_tokens = 0
    async for delta in router.generate(GenerateRequest("listeners-0", list(range(3, 30)), params)):
        num_tokens += len(delta.new_token_ids)
    return num_tokens


def test_a_default_single_node_deployment_keeps_its_own_listeners_on_loopback(tiny_checkpoint: Path) -> None:
    if shutil.which("ss") is None:
        pytest.skip("no `ss` on this host")
    if not available_backends()["mooncake"]:
        pytest.skip("the Mooncake backend does not import on this host")
    if ray.is_initialized():
        pytest.skip("needs to start its own Ray cluster")
    config = ServeConfig(model=str(tiny_checkpoint), **ENGINE)  # the defaults: ray, mooncake, 1P1D
    assert (config.launcher, config.transfer, config.host) == ("ray", "mooncake", "127.0.0.1")
    deployment = start_deployment(config)
    try:
        router = deployment.client
        (decode,), (prefill,) = router.decode, router.prefill
        control = asyncio.run(decode.addresses())
        replicas = {"decode": decode.actor, "prefill": prefill.actor}
        pids = {name: ray.get(actor.__ray_call__.remote(lambda self: os.getpid())) for name, actor in replicas.items()}
        advertised = {name: ray.get(actor.node_addresses.remote()) for name, actor in replicas.items()}
        sockets = listeners()
        assert asyncio.run(generate(router)) == 4
    finally:
        deployment.shutdown()

    assert all(a.startswith("127.0.0.1:") for a in control), control
    for name, at in advertised.items():
        assert at.host == "127.0.0.1" and at.transfer_endpoint.startswith("127.0.0.1:"), (name, at)
    decode_sockets = sockets[pids["decode"]]
    for address in control:  # DecodeControl: on loopback, and nowhere else
        assert [a for a, p in decode_sockets if p == port_of(address)] == ["127.0.0.1"], decode_sockets
    for name, pid in pids.items():
        exposed = [(a, p) for a, p in sockets[pid] if not is_loopback(a)]
        assert port_of(advertised[name].transfer_endpoint) in {p for _, p in exposed}  # Mooncake RPC: every interface
        assert len(exposed) <= NOT_NARROWABLE, f"{name}: a new listener off loopback: {exposed}"

    readme = (REPO / "deploy" / "README.md").read_text()
    exposure = readme[readme.index("## Network exposure"):]
    for named in ("gcs_server", "raylet", "dashboard agent", "runtime env agent", "core worker", "Mooncake RPC",
                  "Mooncake TCP transfer", "UCX", "DecodeControl", "networkpolicy.yaml"):
        assert named in exposure, f"deploy/README.md, Network exposure: names no {named!r}"
