"""The tensor-parallel ranks of one engine, led by rank 0.

Rank 0 runs the scheduler and sampler; every other rank only holds its shard of the weights and cache. Each
action that touches the model or the caches (a step, a handoff) is broadcast by rank 0 and performed by every
rank in the same order, so the collectives inside the forward pass line up by construction:

    rank 0:   lead(("step", output)) -> execute      lead(("handoff", job)) -> push, gather
    rank r:   follow() -> execute                    follow() -> push, gather

A group owns its process groups (not torch.distributed's default one), so several TP engines' rank 0 can share
a process: `control` (lead/follow only, no timeout to speak of), `pg` (gathers and a CPU engine's model
collectives, bounded by `timeout_s`), and on a CUDA engine whose ranks each have a GPU an NCCL group for the
model's collectives (`K3SERVE_TP_NCCL=0` opts out). `TPGroup()` returns once every rank has joined (bounded by
`_JOIN_TIMEOUT`) and leaves no listening port behind but NCCL's. How the ranks meet, which addresses they bind and
dial, what each store holds and when NCCL is chosen: docs/design/tp_rendezvous.md.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import warnings
from typing import Any, Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from k3serve.engine.host_ip import uri_host
from k3serve.model.parallel import TensorParallel

_IDLE_TIMEOUT = datetime.timedelta(days=365)  # how long a follower waits for rank 0's next action
_JOIN_TIMEOUT = datetime.timedelta(seconds=600)  # how long the ranks take to find each other
# Unset or "1": a CUDA engine's model collectives on NCCL where every rank can (and graphs at TP > 1); "0" on
# any rank: gloo. The default since it ran on two GPUs (tests/engine/test_tp_nccl_gpu.py, benchmarks/gpu_tp.py).
NCCL_SWITCH = "K3SERVE_TP_NCCL"


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
        self.rank, self.world_size, self.host = rank, world_size, host
        self._model_group = None  # the NCCL group, or pg, once `tensor_parallel` chose for a CUDA model
        self._timeout = timeout = datetime.timedelta(seconds=timeout_s)
        self._join = join = max(timeout, _JOIN_TIMEOUT)  # every rank loads its libraries and joins
        hosted = None  # rank 0's own store, when it was handed no client: held until every rank joined
        if rank == 0 and store is None:
            hosted = dist.TCPStore(url.hostname, url.port, world_size, is_master=True, timeout=join,
                                   wait_for_workers=False)
        try:  # gloo waits for its peers' addresses as long as its groups' timeout: joining is bounded
            client = store if store is not None else _client(init_method, world_size, join)
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

    def tensor_parallel(self, device: str = "cpu") -> TensorParallel:
        """This rank's `TensorParallel` for a model on `device` (the engine's, as every rank was given it). On
        CUDA the first call binds this rank to `rank_device(device, ...)` and chooses the model's group:
        NCCL's, joined here, where it can be (module docstring), else gloo's. A collective the first time
        on CUDA: every rank calls it, in the same order."""
        if torch.device(device).type != "cuda":
            return TensorParallel(self.rank, self.world_size, group=self.pg)
        if self._model_group is None:
            cuda = rank_device(device, self.rank, self.world_size)
            torch.cuda.set_device(cuda)  # Triton and graph capture use the current device, not the tensors'
            self._model_group = self._join_nccl(cuda) or self.pg
        return TensorParallel(self.rank, self.world_size, group=self._model_group)

    def lead(self, action: tuple) -> None:
        """Rank 0: announce the next action to every rank."""
        _broadcast_object(self.control, action, is_root=True)

    def follow(self) -> tuple:
        """Ranks > 0: wait for rank 0's next action."""
        return _broadcast_object(self.control, None, is_root=False)

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value` at rank 0 (None elsewhere)."""
        values = self.all_gather(value)
        return values if self.is_leader else None

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank (a collective on the gloo group)."""
        data = pickle.dumps(value)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        longest = int(max(s.item() for s in sizes))
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self.pg.allgather([out], [mine]).wait()
        return [pickle.loads(t[: int(n.item())].numpy().tobytes()) for t, n in zip(out, sizes)]

    def close(self) -> None:
        """Drop the connections; the group is unusable afterwards. Safe to call twice. The NCCL group is
        left to the model that holds it: NCCL's destroy, or abort, waits until every CUDA graph that
        captured its collectives is gone (`DecodeGraphs` lets its graphs go first)."""
        self.control = self.pg = self._model_group = None

    def _join_nccl(self, cuda: torch.device) -> Any | None:
        """The model's NCCL group on `cuda`, its communicator made; None where every rank cannot have one
        (then rank 0 warns why, unless every rank opted out: NCCL is the default). Every rank offers whether
        it asked, its GPU (None: it did not ask, or its torch has no NCCL) and rank 0 the address of the
        group's store; all decide alike from what all offered."""
        asked = nccl_requested()
        wants = asked and dist.is_nccl_available()
        store, init = leader_store(self.world_size, self.host, self._join.total_seconds()) \
            if self.is_leader and wants else (None, None)
        offers = self.all_gather((asked, str(torch.cuda.get_device_properties(cuda).uuid) if wants else None, init))
        init = offers[0][2]
        why = _nccl_refused([(asked, gpu) for asked, gpu, _ in offers])
        if why is not None:
            if self.is_leader and any(asked for asked, _, _ in offers):
                warnings.warn(f"TP group: the model's collectives run on gloo, through the host (no CUDA "
                              f"graphs): {why}; {NCCL_SWITCH}=0 on every rank chooses gloo without this warning",
                              stacklevel=2)
            return None
        try:
            client = store if store is not None else _client(init, self.world_size, self._join)
            group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", client), self.rank, self.world_size,
                                          timeout=self._timeout)
            warm_up = torch.ones(1, device=cuda)
            group.allreduce([warm_up]).wait()  # creates the communicator: before any capture
            total = warm_up.item()
        except RuntimeError as e:
            raise RuntimeError(f"TP group: rank {self.rank} of {self.world_size} failed to join the NCCL "
                               f"group on {cuda} at {init}: {e}") from e
        if total != self.world_size:
            raise RuntimeError(f"TP group: the NCCL warm-up all-reduce of ones gave {total} on rank {self.rank}, "
                               f"not {self.world_size}")
        return group


def rank_device(device: str, rank: int, world_size: int) -> torch.device:
    """The device rank `rank` of an engine on `device` uses: "cuda" without an index, at TP > 1, is GPU
    `rank` modulo the GPUs this process sees (one each on a node's GPUs; GPU 0 where a launcher shows a
    rank only its own, as Ray does); any other device is every rank's as given."""
    dev = torch.device(device)
    if dev.type != "cuda" or dev.index is not None or world_size == 1:
        return dev
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError(f"TP rank {rank}: device {device!r} but this process sees no CUDA device")
    return torch.device("cuda", rank % count)


def nccl_requested() -> bool:
    """Whether this process asks for NCCL model collectives: unless `K3SERVE_TP_NCCL=0` (the opt-out)."""
    value = os.environ.get(NCCL_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{NCCL_SWITCH}={value!r}: must be 0 (model collectives on gloo) or 1 (NCCL)")
    return value == "1"


def _nccl_refused(offers: list[tuple[bool, str | None]]) -> str | None:
    """Why the ranks that made these offers (by rank: whether it asked for NCCL, its GPU or None) cannot
    share an NCCL group; None where they can."""
    opted_out = [rank for rank, (asked, _) in enumerate(offers) if not asked]
    if opted_out:
        return f"rank(s) {opted_out} set {NCCL_SWITCH}=0"
    without_nccl = [rank for rank, (_, gpu) in enumerate(offers) if gpu is None]
    if without_nccl:
        return f"rank(s) {without_nccl} on a torch without NCCL"
    gpus = [gpu for _, gpu in offers]
    if len(set(gpus)) < len(gpus):
        return "ranks share a GPU (NCCL needs one GPU per rank)"
    return None


def _client(init_method: str, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A client of the store at `init_method` (tcp://host:port)."""
    url = urlparse(init_method)
    return dist.TCPStore(url.hostname, url.port, world_size, is_master=False, timeout=timeout)


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
