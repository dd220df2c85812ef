"""A decode engine's rank > 0: a model shard, a cache shard, a transfer agent with its own handshake-only
control server, and the loop that performs whatever rank 0 announces (steps, address and checksum gathers).
Started as a process (`--launcher local`) or inside a Ray actor, before rank 0 is constructed (the group forms
when all have joined).
"""

from __future__ import annotations

from typing import Callable

from k3serve.decode.handoff import HandshakeOnly, make_receiver
from k3serve.engine.config import EngineArgs
from k3serve.engine.kv_handoff import join_follower
from k3serve.transfer.auth import ControlAuth, process_auth
from k3serve.transfer.control import DecodeControlServer


def follower_main(
    rank: int, args: EngineArgs, init_method: str, transfer: str, host: str = "127.0.0.1", prefill_tp: int = 1,
    transfer_options: dict | None = None, num_threads: int | None = None, control_auth: ControlAuth | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """`host`: this node's address (control server, group sockets; the transfer agent's, via
    `transfer_options`). `on_started`: called once this rank is ready to follow (the local launcher waits
    for it). `control_auth`: the deployment's (transfer/auth.py; default this process's own)."""
    follower = join_follower(rank, args, init_method, num_threads, host)
    try:
        receiver = make_receiver(follower.cache_view, transfer, transfer_options, prefill_tp)
        auth = control_auth or process_auth()
        server = DecodeControlServer(HandshakeOnly(receiver), receiver.compat_hash, host=host, secret=auth.secret,
                                     tls=auth.tls()).start()
        try:
            if on_started is not None:
                on_started()
            follower.serve({"addresses": lambda: server.address, "checksums": receiver.landed_checksums})
        finally:
            server.stop(grace=1.0)
            receiver.close()
    finally:
        follower.close()
