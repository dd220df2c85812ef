"""The tensor-parallel ranks of one engine, led by rank 0.

Rank 0 runs the scheduler and sampler; every other rank only holds its shard of the weights and
cache. Each action that touches the model or the caches (a step, a handoff) is broadcast by rank
0 and performed by every rank in the same order, so the collectives inside the forward pass
line up by construction:

    rank 0:   lead(("step", output)) -> execute      lead(("handoff", job)) -> push, gather
    rank r:   follow() -> execute                    follow() -> push, gather

A group owns its process groups (gloo, meeting on a TCP store at `init_method`, rank 0 hosting
it) instead of torch.distributed's one default group, so several TP engines can live in one
process (e.g. a prefill and a decode engine's rank 0 under `--launcher local`). Two of them:

    control   lead/follow only; a follower waits here between actions, as long as rank 0 is
              idle (no timeout to speak of: a dead peer still fails it at once, its connection
              closes)
    pg        everything else: gathers, and the model's all-reduces (`tensor_parallel()`), with
              `timeout_s`, so a rank stuck inside an action fails the others

Addresses: rank 0 opens the store on a port of its own node (`leader_store`: the kernel picks it,
so nothing races for it) and publishes `tcp://<its host>:<port>` for the followers to join; every
rank's gloo sockets listen on its own `host`, which its peers dial (gloo's default would be
whatever the hostname resolves to, often 127.0.0.1, unreachable from another node).

The store is a rendezvous only: gloo reads its peers' addresses there while a group is created,
never afterwards, and a TP engine's ranks live and die together (nothing re-joins). So once every
rank has joined (a barrier), rank 0 lets go of it: no listening port outlives `TPGroup()`. Each rank's
groups hold a store *client* (gloo keeps whatever store it was given alive for as long as the group
lives; a client's socket to the closed store is never used again), and rank 0's store itself is
held only while joining: by `TPGroup()` when rank 0 opens it itself, else by whoever opened it with
`leader_store`, who hands rank 0 a client of it and may drop it before the join ends to abort it
(rank 0's join then fails at once: a launcher whose follower failed). Joining is bounded
(`_JOIN_TIMEOUT` or `timeout_s`, the longer): a rank that never comes fails the others' `TPGroup()`
with an error naming the group, rather than leaving them waiting as long as a follower may idle.
"""

from __future__ import annotations

import datetime
import pickle
import socket
from typing import Any, Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from k3serve.engine.host_ip import uri_host
from k3serve.model.parallel import TensorParallel

_IDLE_TIMEOUT = datetime.timedelta(days=365)  # how long a follower waits for rank 0's next action
_JOIN_TIMEOUT = datetime.timedelta(seconds=600)  # how long the ranks take to find each other


def leader_store(world_size: int, host: str, timeout_s: float = 600.0) -> tuple[dist.TCPStore, str]:
    """Rank 0, before its followers start: the group's store listening on a free port of `host`
    (that interface only: TCPStore by itself listens on all of them), and the init_method
    (`tcp://host:port`) the followers join; pass both to rank 0's `TPGroup`."""
    timeout = max(datetime.timedelta(seconds=timeout_s), _JOIN_TIMEOUT)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        listener.bind((host, 0))
        listener.listen(world_size)
        port = listener.getsockname()[1]
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now
    return store, f"tcp://{uri_host(host)}:{port}"


class TPGroup:
    def __init__(
        self, rank: int, world_size: int, init_method: str, timeout_s: float = 600.0, host: str = "127.0.0.1",
        store: dist.TCPStore | None = None,
    ) -> None:
        """Join (rank 0: host) the group at `init_method`; this rank's sockets listen on `host`.
        Rank 0 passes a client of `leader_store`'s store (its `clone()`) when its followers were given
        its address, and keeps the store until this returns, then drops it (its port closes); dropping
        it sooner fails the join at once. (The client is connected before the join: a client would
        retry a store that is gone for as long as the join timeout.)"""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
        if store is not None and rank != 0:
            raise ValueError(f"rank {rank} joins rank 0's store: only rank 0 passes one")
        self.rank, self.world_size = rank, world_size
        timeout = datetime.timedelta(seconds=timeout_s)
        join = max(timeout, _JOIN_TIMEOUT)  # every rank loads its libraries and joins
        hosted = None  # rank 0's own store, when it was handed no client: held until every rank joined
        if rank == 0 and store is None:
            hosted = dist.TCPStore(url.hostname, url.port, world_size, is_master=True, timeout=join,
                                   wait_for_workers=False)
        try:  # gloo waits for its peers' addresses as long as its groups' timeout: joining is bounded
            client = store
            if client is None:
                client = dist.TCPStore(url.hostname, url.port, world_size, is_master=False, timeout=join)
            self.control = _gloo(dist.PrefixStore("control", client), rank, world_size, host, join)
            self.pg = _gloo(dist.PrefixStore("pg", client), rank, world_size, host, timeout)
            everyone_joined = dist.BarrierOptions()
            everyone_joined.timeout = join
            self.pg.barrier(everyone_joined).wait()  # past it no rank reads the store again
        except RuntimeError as e:
            raise RuntimeError(f"TP group at {init_method}: rank {rank} of {world_size} did not meet every "
                               f"other rank within {join.total_seconds():g} s: {e}") from e

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
        self.control = self.pg = None


def _gloo(store: dist.Store, rank: int, world_size: int, host: str, timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """A gloo group whose sockets listen on `host` (its peers dial that address)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _broadcast_object(pg, value: Any, is_root: bool) -> Any:
    """`value` from rank 0 to every rank of `pg` (length, then pickled bytes)."""
    data = pickle.dumps(value) if is_root else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    idle = dist.BroadcastOptions()
    idle.timeout = _IDLE_TIMEOUT  # a follower waits for rank 0's next action (the group's own timeout bounds joining)
    pg.broadcast([length], idle).wait()
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if is_root else torch.empty(int(length.item()), dtype=torch.uint8)
    pg.broadcast([buf], idle).wait()
    return value if is_root else pickle.loads(buf.numpy().tobytes())


def follow_forever(group: TPGroup, actions: dict[str, Callable[..., None]]) -> None:
    """A follower rank's whole life: perform rank 0's actions until it says "stop"."""
    while True:
        kind, *payload = group.follow()
        if kind == "stop":
            return
        actions[kind](*payload)
