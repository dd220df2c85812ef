"""Ray actors hosting one prefill or decode worker each (imported only with `--launcher ray`).

An actor is a replica: Ray restarts it when it dies (`max_restarts=-1`); a restarted decode
actor publishes a new control address, which the router picks up on its next refresh. Worker
calls pass through unchanged; the decode stream is a Ray streaming generator.
"""

from __future__ import annotations

from typing import Any

import ray

from k3serve.engine.config import EngineArgs


def _limit_threads(num_threads: int) -> None:
    import torch

    torch.set_num_threads(num_threads)


@ray.remote(max_restarts=-1, max_task_retries=0)
class PrefillActor:
    def __init__(self, engine_kwargs: dict[str, Any], worker_kwargs: dict[str, Any], num_threads: int = 1) -> None:
        from k3serve.prefill.worker import PrefillWorker

        _limit_threads(num_threads)
        self.worker = PrefillWorker(EngineArgs(**engine_kwargs), **worker_kwargs)

    async def prefill(self, request_id, prompt_token_ids, params, target):
        return await self.worker.prefill(request_id, prompt_token_ids, params, target)

    async def abort(self, request_id: str) -> None:
        await self.worker.abort(request_id)

    async def load(self) -> tuple[int, int]:
        return await self.worker.load()

    def shutdown(self) -> None:
        self.worker.shutdown()


@ray.remote(max_restarts=-1, max_task_retries=0)
class DecodeActor:
    def __init__(self, engine_kwargs: dict[str, Any], worker_kwargs: dict[str, Any], num_threads: int = 1) -> None:
        from k3serve.decode.worker import DecodeWorker

        _limit_threads(num_threads)
        self.worker = DecodeWorker(EngineArgs(**engine_kwargs), **worker_kwargs)

    def control_address(self) -> str:
        return self.worker.control_address

    async def admit(self, request_id, prompt_token_ids, params):
        return await self.worker.admit(request_id, prompt_token_ids, params)

    async def stream(self, request_id: str):
        async for delta in self.worker.stream(request_id):
            yield delta

    async def abort_request(self, request_id: str) -> None:
        await self.worker.abort_request(request_id)

    async def stats(self):
        return await self.worker.stats()

    def shutdown(self) -> None:
        self.worker.shutdown()
