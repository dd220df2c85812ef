"""The tensor-parallel ranks of one engine, led by rank 0.

Rank 0 runs the scheduler and sampler; every other rank only holds its shard of the weights and
cache. Each action that touches the model or the caches (a step, a handoff) is broadcast by rank
0 and performed by every rank in the same order, so the collectives inside the forward pass
line up by construction:

    rank 0:   lead(("step", output)) -> execute      lead(("handoff", job)) -> push, gather
    rank r:   follow() -> execute                    follow() -> push, gather

A group owns its process groups (gloo, on its own TCP store at `init_method`, rank 0 hosting
it) instead of torch.distributed's one default group, so several TP engines can live in one
process (e.g. a prefill and a decode engine's rank 0 under `--launcher local`). Two of them:

    control   lead/follow only; a follower waits here between actions, as long as rank 0 is
              idle (no timeout to speak of: a dead peer still fails it at once, its connection
              closes)
    pg        everything else: gathers, and the model's all-reduces (`tensor_parallel()`), with
              `timeout_s`, so a rank stuck inside an action fails the others
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any, Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from k3serve.model.parallel import TensorParallel

_IDLE_TIMEOUT = datetime.timedelta(days=365)  # how long a follower waits for rank 0's next action
_JOIN_TIMEOUT = datetime.timedelta(seconds=600)  # how long the ranks take to find each other


class TPGroup:
    def __init__(self, rank: int, world_size: int, init_method: str, timeout_s: float = 600.0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
        self.rank, self.world_size = rank, world_size
        timeout = datetime.timedelta(seconds=timeout_s)
        join = max(timeout, _JOIN_TIMEOUT)  # every rank loads its libraries and joins
        self._store = dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0, timeout=join)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", self._store), rank, world_size, _IDLE_TIMEOUT)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", self._store), rank, world_size, timeout)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def tensor_parallel(self) -> TensorParallel:
        """This rank's `TensorParallel`, reducing over this group."""
        return TensorParallel(self.rank, self.world_size, group=self.pg)

    def lead(self, action: tuple) -> None:
        """Rank 0: announce the next action to every rank."""
        _broadcast_object(self.control, action, is_root=True)

    def follow(self) -> tuple:
        """Ranks > 0: wait for rank 0's next action."""
        return _broadcast_object(self.control, None, is_root=False)

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value` at rank 0 (None elsewhere)."""
        data = pickle.dumps(value)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        longest = int(max(s.item() for s in sizes))
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self.pg.allgather([out], [mine]).wait()
        if not self.is_leader:
            return None
        return [pickle.loads(t[: int(n.item())].numpy().tobytes()) for t, n in zip(out, sizes)]

    def close(self) -> None:
        """Drop the connections; the group is unusable afterwards. Safe to call twice."""
        self.control = self.pg = self._store = None


def _broadcast_object(pg, value: Any, is_root: bool) -> Any:
    """`value` from rank 0 to every rank of `pg` (length, then pickled bytes)."""
    data = pickle.dumps(value) if is_root else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    pg.broadcast([length], dist.BroadcastOptions()).wait()
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if is_root else torch.empty(int(length.item()), dtype=torch.uint8)
    pg.broadcast([buf], dist.BroadcastOptions()).wait()
    return value if is_root else pickle.loads(buf.numpy().tobytes())


def follow_forever(group: TPGroup, actions: dict[str, Callable[..., None]]) -> None:
    """A follower rank's whole life: perform rank 0's actions until it says "stop"."""
    while True:
        kind, *payload = group.follow()
        if kind == "stop":
            return
        actions[kind](*payload)
