"""A prefill engine's rank > 0: a model shard, a cache shard, a transfer agent, and a loop that
performs whatever rank 0 announces (steps and handoffs). Started as a process (`--launcher
local`) or inside a Ray actor, before rank 0 is constructed (the group forms when all have joined).
"""

from __future__ import annotations

from typing import Callable

from k3serve.engine.config import EngineArgs
from k3serve.engine.follower import join_engine
from k3serve.engine.tp_group import follow_forever
from k3serve.prefill.worker import make_sender


def follower_main(
    rank: int, args: EngineArgs, init_method: str, transfer: str, transfer_options: dict | None = None,
    num_threads: int | None = None, host: str = "127.0.0.1", on_started: Callable[[], None] | None = None,
) -> None:
    """`host`: this node's address (group sockets; the transfer agent's, via `transfer_options`).
    `on_started`: called once this rank is ready to follow (the local launcher waits for it)."""
    group, runner, config = join_engine(rank, args, init_method, num_threads, host)
    try:
        sender = make_sender(args, runner, config, rank, transfer, transfer_options)
        try:
            if on_started is not None:
                on_started()
            follow_forever(group, {
                "step": lambda output, want: runner.execute(output, want),
                "handoff": lambda job: group.gather(sender.push(job)),
            })
        finally:
            sender.close()
    finally:
        group.close()
