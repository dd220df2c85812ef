"""A decode engine's rank > 0: a model shard, a cache shard, a transfer agent with its own
handshake-only control server, and a loop that performs whatever rank 0 announces (steps,
address and checksum gathers). Started as a process (`--launcher local`) or inside a Ray actor,
before rank 0 is constructed (the group forms when all have joined).
"""

from __future__ import annotations

from typing import Callable

from k3serve.decode.handoff import HandshakeOnly, make_receiver
from k3serve.engine.config import EngineArgs
from k3serve.engine.follower import join_engine
from k3serve.engine.tp_group import follow_forever
from k3serve.transfer.control import DecodeControlServer


def follower_main(
    rank: int, args: EngineArgs, init_method: str, transfer: str, host: str = "127.0.0.1", prefill_tp: int = 1,
    transfer_options: dict | None = None, num_threads: int | None = None, on_started: Callable[[], None] | None = None,
) -> None:
    """`host`: this node's address (control server, group sockets; the transfer agent's, via
    `transfer_options`). `on_started`: called once this rank is ready to follow (the local launcher waits
    for it)."""
    group, runner, config = join_engine(rank, args, init_method, num_threads, host)
    try:
        receiver = make_receiver(args, runner, config, rank, transfer, transfer_options,
                                 prefill_tp)
        server = DecodeControlServer(HandshakeOnly(receiver), receiver.compat_hash, host=host).start()
        try:
            if on_started is not None:
                on_started()
            follow_forever(group, {
                "step": lambda output, want: runner.execute(output, want),
                "addresses": lambda: group.gather(server.address),
                "checksums": lambda block_ids, slot_id, num_tokens: group.gather(
                    receiver.landed_checksums(block_ids, slot_id, num_tokens)),
            })
        finally:
            server.stop(grace=1.0)
            receiver.close()
    finally:
        group.close()
