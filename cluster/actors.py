"""Ray actors hosting one prefill or decode worker each (imported only with `--launcher ray`).

An actor is a replica: Ray restarts it when it dies (`max_restarts=-1`); a restarted decode
actor publishes new control addresses, which the router reads when it opens its new feed there. A TP
replica (rank 0 plus `*RankActor` followers in a placement group) is started with
`max_restarts=0`: its ranks live and die together. Every rank binds and advertises its node's
address, chosen in the actor (`cluster/node_address.py`); a TP replica's rank 0 picks the group's
address on its own node before the followers start (`_Rank0`). Worker
calls pass through unchanged; a decode feed (one per router: every delta of a step in one item)
is a Ray streaming generator.
"""

from __future__ import annotations

from typing import Any

import ray

from k3serve.cluster.node_address import ReplicaAddresses, node_ip
from k3serve.engine.config import EngineArgs
from k3serve.transfer.auth import ControlAuth
from k3serve.transfer.backend import TransferBackend
from k3serve.transfer.backends import host_options


def _on_this_node(transfer: str, advertise_host: str | None) -> tuple[str, dict[str, Any]]:
    """This node's address (chosen here, where the rank runs) and the transfer options that make
    the rank's agent reachable at it."""
    host = node_ip(advertise_host)
    return host, host_options(transfer, host)


class _Rank0:
    """Rank 0 of an engine, on the node Ray placed it. TP 1: the worker is built at once (and again
    on a restart, wherever that lands). TP > 1, in two steps, so that rank 0 picks the group's
    address on its own node: `tp_init_method()` opens the group's store on a free port here and
    answers `tcp://<this node>:<port>`, the driver starts the followers with it, then `start()`
    waits for them and builds the worker."""

    def _new_worker(self, *args: Any, **kwargs: Any) -> Any:
        """The worker (imported here, in the actor: the driver that defines the actor class needs no torch)."""
        raise NotImplementedError

    def __init__(
        self, engine_kwargs: dict[str, Any], worker_kwargs: dict[str, Any], num_threads: int = 1,
        advertise_host: str | None = None,
    ) -> None:
        import torch

        torch.set_num_threads(num_threads)
        self.host, transfer_options = _on_this_node(worker_kwargs["transfer"], advertise_host)
        self.args = EngineArgs(**engine_kwargs)
        self.worker_kwargs = {**worker_kwargs, "transfer_options": transfer_options, **self._host_kwargs()}
        self.worker = self._store = self._init_method = None
        if self.args.tensor_parallel_size == 1:
            self.worker = self._new_worker(self.args, **self.worker_kwargs)

    def _host_kwargs(self) -> dict[str, Any]:
        """Worker kwargs that bind its own servers on this node's address."""
        return {}

    def tp_init_method(self) -> str:
        """TP > 1, first: the address the followers join (a port of this node, open until `start()`)."""
        from k3serve.engine.tp_group import leader_store

        if self._init_method is None:
            self._store, self._init_method = leader_store(self.args.tensor_parallel_size, self.host)
        return self._init_method

    def start(self) -> None:
        """TP > 1, once the followers were started with `tp_init_method()`: the group (rank 0's store
        closes once every rank has joined), the worker."""
        from k3serve.engine.tp_group import TPGroup

        if self._store is None:
            raise RuntimeError("start() without tp_init_method() first, or twice: no store for the followers to join")
        group = TPGroup(0, self.args.tensor_parallel_size, self._init_method, host=self.host,
                        store=self._store.clone())
        self._store = None  # every rank joined (the group holds a client of it only): its port closes now
        self.worker = self._new_worker(self.args, group=group, **self.worker_kwargs)

    def _agent(self) -> TransferBackend:
        raise NotImplementedError

    def node_addresses(self) -> ReplicaAddresses:
        """Where peers reach this rank, as it advertises them (transfer agent, TP group)."""
        return ReplicaAddresses(self.host, self._agent().agent_info().endpoint, self._init_method)

    async def stats(self):
        return await self.worker.stats()

    async def metrics_text(self) -> str:
        return await self.worker.metrics_text()

    def shutdown(self) -> None:
        if self.worker is not None:  # None: a TP rank 0 whose group never formed
            self.worker.shutdown()


@ray.remote(max_restarts=-1, max_task_retries=0)
class PrefillActor(_Rank0):
    """Rank 0 of a prefill engine (the whole engine when TP is 1)."""

    def _new_worker(self, *args: Any, **kwargs: Any) -> Any:
        from k3serve.prefill.worker import PrefillWorker

        return PrefillWorker(*args, **kwargs)

    def _agent(self) -> TransferBackend:
        return self.worker.sender.backend

    async def prefill(self, request_id, prompt_token_ids, params, target):
        return await self.worker.prefill(request_id, prompt_token_ids, params, target)

    async def abort(self, request_id: str) -> None:
        await self.worker.abort(request_id)


@ray.remote(max_restarts=0)
class PrefillRankActor:
    """Rank > 0 of a TP prefill engine: follows rank 0 until it stops."""

    def run(self, rank: int, engine_kwargs: dict[str, Any], init_method: str, transfer: str,
            advertise_host: str | None = None, num_threads: int = 1, control_auth: ControlAuth | None = None) -> None:
        from k3serve.prefill.rank import follower_main

        host, transfer_options = _on_this_node(transfer, advertise_host)
        follower_main(rank, EngineArgs(**engine_kwargs), init_method, transfer, transfer_options,
                      num_threads=num_threads, host=host, control_auth=control_auth)


@ray.remote(max_restarts=0)
class DecodeRankActor:
    """Rank > 0 of a TP decode engine: follows rank 0 until it stops; answers handshakes."""

    def run(self, rank: int, engine_kwargs: dict[str, Any], init_method: str, transfer: str,
            advertise_host: str | None = None, prefill_tp: int = 1, num_threads: int = 1,
            control_auth: ControlAuth | None = None) -> None:
        from k3serve.decode.rank import follower_main

        host, transfer_options = _on_this_node(transfer, advertise_host)
        follower_main(rank, EngineArgs(**engine_kwargs), init_method, transfer, host, prefill_tp,
                      transfer_options, num_threads=num_threads, control_auth=control_auth)


@ray.remote(max_restarts=-1, max_task_retries=0)
class DecodeActor(_Rank0):
    """Rank 0 of a decode engine (the whole engine when TP is 1)."""

    def _new_worker(self, *args: Any, **kwargs: Any) -> Any:
        from k3serve.decode.worker import DecodeWorker

        return DecodeWorker(*args, **kwargs)

    def _agent(self) -> TransferBackend:
        return self.worker.receiver.backend

    def _host_kwargs(self) -> dict[str, Any]:
        return {"host": self.host}  # the control server

    def control_address(self) -> str:
        """Rank 0's control address."""
        return self.worker.control_address

    def control_addresses(self) -> tuple[str, ...]:
        """Every rank's control address, rank order (what a HandoffTarget names)."""
        return self.worker.control_addresses

    async def admit(self, request_id, prompt_token_ids, params, feed: str):
        return await self.worker.admit(request_id, prompt_token_ids, params, feed)

    async def feed(self, feed_id: str):
        async for batch in self.worker.feed(feed_id):
            yield batch

    async def abort_request(self, request_id: str) -> None:
        await self.worker.abort_request(request_id)
