"""The tensor-parallel ranks of one engine, led by rank 0.

Rank 0 runs the scheduler and sampler; every other rank only holds its shard of the weights and
cache. Each action that touches the model or the caches (a step, a handoff) is broadcast by rank
0 and performed by every rank in the same order, so the collectives inside the forward pass
line up by construction:

    rank 0:   lead(("step", output)) -> execute      lead(("handoff", job)) -> push, gather
    rank r:   follow() -> execute                    follow() -> push, gather
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch.distributed as dist


class TPGroup:
    def __init__(self, rank: int, world_size: int, init_method: str, timeout_s: float = 600.0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.rank, self.world_size = rank, world_size
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def lead(self, action: tuple) -> None:
        """Rank 0: announce the next action to every rank."""
        dist.broadcast_object_list([action], src=0)

    def follow(self) -> tuple:
        """Ranks > 0: wait for rank 0's next action."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value` at rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.world_size if self.is_leader else None
        dist.gather_object(value, out, dst=0)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def follow_forever(group: TPGroup, actions: dict[str, Callable[..., None]]) -> None:
    """A follower rank's whole life: perform rank 0's actions until it says "stop"."""
    while True:
        kind, *payload = group.follow()
        if kind == "stop":
            return
        actions[kind](*payload)
