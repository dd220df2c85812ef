"""The address that processes on other nodes use to reach a worker: chosen where the worker runs.

A decode rank's control server, every rank's Mooncake engine and a TP group's rendezvous (rank
0's store, every rank's gloo sockets) must be reachable from other nodes, so each worker asks,
on its own node (vLLM's `get_ip()` / `VLLM_HOST_IP` likewise):

    1. the deployment's `advertise_host` (config)  one address for every worker: one node only
    2. $K3SERVE_HOST_IP                            per node (the Helm chart sets it to the pod IP)
    3. Ray's node IP                               inside a Ray actor (what Ray itself uses)
    4. 127.0.0.1                                   no Ray: one machine (`--launcher local`)

The answer must be an IP literal (a server binds on it; a peer dials it), never 0.0.0.0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from k3serve.engine.host_ip import check_host_ip

HOST_IP_ENV = "K3SERVE_HOST_IP"
LOOPBACK = "127.0.0.1"


def node_ip(advertise_host: str | None = None) -> str:
    """This node's address for its workers' servers, in the order of the module docstring."""
    if advertise_host:
        return check_host_ip(advertise_host, "advertise_host")
    if os.environ.get(HOST_IP_ENV):
        return check_host_ip(os.environ[HOST_IP_ENV], HOST_IP_ENV)
    return _ray_node_ip() or LOOPBACK


def _ray_node_ip() -> str | None:
    """Ray's address of the node this process runs on, if this process is part of a Ray cluster."""
    try:
        import ray
    except ImportError:
        return None
    return ray.util.get_node_ip_address() if ray.is_initialized() else None


@dataclass(frozen=True)
class ReplicaAddresses:
    """Where peers reach a replica's rank 0, as that rank reports it (`k3serve` asserts nothing
    from config: these are the addresses in use)."""

    host: str  # this node's address: control server (decode), gloo sockets
    transfer_endpoint: str  # the transfer agent's AgentInfo.endpoint (Mooncake: host:rpc_port)
    tp_init_method: str | None  # tcp://host:port of its TP group's store; None when TP is 1
