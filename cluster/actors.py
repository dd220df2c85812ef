"""Ray actors hosting one prefill or decode worker each (imported only with `--launcher ray`).

An actor is a replica: Ray restarts it when it dies (`max_restarts=-1`); a restarted decode
actor publishes a new control address, which the router picks up on its next refresh. A TP
replica (rank 0 plus `*RankActor` followers in a placement group) is started with
`max_restarts=0`: its ranks live and die together. Worker
calls pass through unchanged; a decode feed (one per router: every delta of a step in one item)
is a Ray streaming generator.
"""

from __future__ import annotations

from typing import Any

import ray

from k3serve.engine.config import EngineArgs


def _rank0_worker(worker_cls, engine_kwargs: dict[str, Any], worker_kwargs: dict[str, Any], num_threads: int,
                  init_method: str | None):
    """Rank 0's worker; with `init_method`, it leads a TP group whose followers are starting too."""
    import torch

    from k3serve.engine.tp_group import TPGroup

    torch.set_num_threads(num_threads)
    args = EngineArgs(**engine_kwargs)
    group = TPGroup(0, args.tensor_parallel_size, init_method) if init_method else None
    return worker_cls(args, group=group, **worker_kwargs)


@ray.remote(max_restarts=-1, max_task_retries=0)
class PrefillActor:
    """Rank 0 of a prefill engine (the whole engine when TP is 1)."""

    def __init__(
        self, engine_kwargs: dict[str, Any], worker_kwargs: dict[str, Any], num_threads: int = 1,
        init_method: str | None = None,
    ) -> None:
        from k3serve.prefill.worker import PrefillWorker

        self.worker = _rank0_worker(PrefillWorker, engine_kwargs, worker_kwargs, num_threads, init_method)

    async def prefill(self, request_id, prompt_token_ids, params, target):
        return await self.worker.prefill(request_id, prompt_token_ids, params, target)

    async def abort(self, request_id: str) -> None:
        await self.worker.abort(request_id)

    async def stats(self):
        return await self.worker.stats()

    async def metrics_text(self) -> str:
        return await self.worker.metrics_text()

    def shutdown(self) -> None:
        self.worker.shutdown()


@ray.remote(max_restarts=0)
class PrefillRankActor:
    """Rank > 0 of a TP prefill engine: follows rank 0 until it stops."""

    def run(self, rank: int, engine_kwargs: dict[str, Any], init_method: str, transfer: str, num_threads: int = 1) -> None:
        from k3serve.prefill.rank import follower_main

        follower_main(rank, EngineArgs(**engine_kwargs), init_method, transfer, num_threads=num_threads)


@ray.remote(max_restarts=0)
class DecodeRankActor:
    """Rank > 0 of a TP decode engine: follows rank 0 until it stops; answers handshakes."""

    def run(self, rank: int, engine_kwargs: dict[str, Any], init_method: str, transfer: str, host: str,
            prefill_tp: int, num_threads: int = 1) -> None:
        from k3serve.decode.rank import follower_main

        follower_main(rank, EngineArgs(**engine_kwargs), init_method, transfer, host, prefill_tp,
                      num_threads=num_threads)


@ray.remote(max_restarts=-1, max_task_retries=0)
class DecodeActor:
    """Rank 0 of a decode engine (the whole engine when TP is 1)."""

    def __init__(
        self, engine_kwargs: dict[str, Any], worker_kwargs: dict[str, Any], num_threads: int = 1,
        init_method: str | None = None,
    ) -> None:
        from k3serve.decode.worker import DecodeWorker

        self.worker = _rank0_worker(DecodeWorker, engine_kwargs, worker_kwargs, num_threads, init_method)

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

    async def stats(self):
        return await self.worker.stats()

    async def metrics_text(self) -> str:
        return await self.worker.metrics_text()

    def shutdown(self) -> None:
        self.worker.shutdown()
