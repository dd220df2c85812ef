"""A Ray-launched disaggregated deployment reaches its workers at the node's address, not 127.0.0.1.

Spec (this machine's first non-loopback IPv4 as `advertise_host`; skipped without one):
- a request through the router (Mooncake, 1 prefill + 1 decode replica of TP 2) gives token for
  token what the colocated engine gives;
- every address in use is that IP, as the running replicas report it: the decode control
  addresses the router hands to prefill (both ranks), the Mooncake endpoints of prefill and
  decode rank 0, and the decode TP group's init method (picked by rank 0 on its node);
- once the group has formed, nothing listens there any more (the store was the rendezvous only).
"""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
ray = pytest.importorskip("ray")  # a test extra; the GPU machine has none

from k3serve.cluster.config import ServeConfig
from k3serve.cluster.serve import start_deployment
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.transfer.backends import available_backends

pytestmark = pytest.mark.timeout(120)

ENGINE = dict(block_size=16, max_model_len=512, cache_memory_bytes=64 << 20)
PROMPT = list(range(3, 40))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def non_loopback_ipv4() -> str | None:
    """The first IPv4 address of this host (`hostname -I`) that is not a loopback one."""
    if shutil.which("hostname") is None:
        return None
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
    ips = [ipaddress.ip_address(a) for a in out if "." in a]
    return next((str(ip) for ip in ips if not ip.is_loopback), None)


def host_of(address: str) -> str:
    """'10.0.0.5:41234' or 'tcp://10.0.0.5:41234' -> '10.0.0.5'."""
    return address.removeprefix("tcp://").rsplit(":", 1)[0]


async def generate(router, request_id: str) -> list[int]:
    tokens = []
    async for delta in router.generate(GenerateRequest(request_id, PROMPT, GREEDY)):
        tokens += delta.new_token_ids
    return tokens


def test_every_advertised_address_is_the_node_ip(tiny_checkpoint: Path) -> None:
    ip = non_loopback_ipv4()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address to advertise")
    if not available_backends()["mooncake"]:
        pytest.skip("the Mooncake backend does not import on this host")
    expected = LLM(model=str(tiny_checkpoint), **ENGINE).generate([PROMPT], GREEDY)[0].outputs[0].token_ids

    config = ServeConfig(model=str(tiny_checkpoint), launcher="ray", transfer="mooncake", decode_tp=2,
                         advertise_host=ip, **ENGINE)
    deployment = start_deployment(config)
    try:
        router = deployment.client
        assert asyncio.run(generate(router, "node-ip-0")) == list(expected)

        (decode,), (prefill,) = router.decode, router.prefill
        control = asyncio.run(decode.addresses())
        assert len(control) == 2 and {host_of(a) for a in control} == {ip}, control
        decode_at = ray.get(decode.actor.node_addresses.remote())
        prefill_at = ray.get(prefill.actor.node_addresses.remote())
        assert host_of(decode_at.transfer_endpoint) == ip and host_of(prefill_at.transfer_endpoint) == ip
        assert host_of(decode_at.tp_init_method) == ip
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((ip, int(decode_at.tp_init_method.rsplit(":", 1)[1])), timeout=5).close()
        assert prefill_at.tp_init_method is None  # TP 1: no group
    finally:
        deployment.shutdown()
