"""A prefill engine's rank > 0: a model shard, a cache shard, a transfer agent, and the loop that performs
whatever rank 0 announces (steps, and its share of each handoff). Started as a process (`--launcher local`) or
inside a Ray actor, before rank 0 is constructed (the group forms when all have joined).
"""

from __future__ import annotations

from typing import Callable

from k3serve.engine.config import EngineArgs
from k3serve.engine.kv_handoff import join_follower
from k3serve.prefill.worker import make_sender
from k3serve.transfer.auth import ControlAuth


def follower_main(
    rank: int, args: EngineArgs, init_method: str, transfer: str, transfer_options: dict | None = None,
    num_threads: int | None = None, host: str = "127.0.0.1", control_auth: ControlAuth | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """`host`: this node's address (group sockets; the transfer agent's, via `transfer_options`).
    `on_started`: called once this rank is ready to follow (the local launcher waits for it).
    `control_auth`: the deployment's (transfer/auth.py)."""
    follower = join_follower(rank, args, init_method, num_threads, host)
    try:
        sender = make_sender(follower.cache_view, transfer, transfer_options, control_auth)
        try:
            if on_started is not None:
                on_started()
            follower.serve({"handoff": sender.push})
        finally:
            sender.close()
    finally:
        follower.close()
