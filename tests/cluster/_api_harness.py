"""Helpers of the ingress tests: the AsyncEngine as an EngineClient, pool-usage checks, and the app served as
`k3serve serve` serves it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import AsyncIterator, Iterator

from k3serve.cluster.config import ServeConfig
from k3serve.cluster.api import build_app
from k3serve.cluster.serve import Deployment, _ingress_server, start_deployment
from k3serve.engine.async_engine import AsyncEngine
from k3serve.engine.outputs import RequestDelta
from k3serve.engine.stream_types import GenerateRequest

ENGINE_ARGS = dict(block_size=16, max_model_len=512, max_num_seqs=8, cache_memory_bytes=64 * 2**20)


class EngineAdapter:
    """AsyncEngine as an EngineClient (model_name, max_model_len, check_health), plus faults."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = getattr(engine, "model_name", None) or engine.engine.model_name
        self.max_model_len = getattr(engine, "max_model_len", None) or engine.engine.args.max_model_len
        self.fail_with: BaseException | None = None
        self.fail_after_first: BaseException | None = None
        self.unhealthy = False
        self.aborted: list[str] = []

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        if self.fail_with is not None:
            return self._fail(self.fail_with)
        if self.fail_after_first is not None:
            return self._fail_mid_stream(request, self.fail_after_first)
        return self.engine.generate(request)

    async def _fail_mid_stream(self, request: GenerateRequest, error: BaseException) -> AsyncIterator[RequestDelta]:
        stream = self.engine.generate(request)
        try:
            yield await stream.__anext__()
            raise error
        finally:
            await stream.aclose()

    async def _fail(self, error: BaseException) -> AsyncIterator[RequestDelta]:
        raise error
        yield  # an async generator

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await self.engine.abort(request_id)

    async def check_health(self) -> None:
        if self.unhealthy:
            raise RuntimeError("unhealthy by request of the test")
        engine_check = getattr(self.engine, "check_health", None)
        if engine_check is not None:
            await engine_check()
        elif not self.engine._thread.is_alive():
            raise RuntimeError("the engine thread stopped")


def pool_usage(engine: AsyncEngine) -> tuple[int, int]:
    """(MLA blocks, KDA slots) in use; prefix-cached blocks and checkpoints do not count."""
    scheduler = engine.engine.scheduler
    return scheduler.block_pool.num_used, scheduler.state_pool.num_used


async def wait_pools_free(engine: AsyncEngine, timeout: float = 5.0) -> float:
    """Seconds until the engine holds no block and no slot; fails after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if pool_usage(engine) == (0, 0) and not engine.engine.has_unfinished():
            return time.monotonic() - start
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still holds (blocks, slots) = {pool_usage(engine)} after {timeout} s")


@contextlib.asynccontextmanager
async def serve_ingress(app, config: ServeConfig | None = None) -> AsyncIterator[int]:
    """`app` behind the uvicorn server `k3serve serve` runs (`serve._ingress_server`: the connection guard, the
    keep-alive timeout) on an ephemeral port of 127.0.0.1, in this event loop; yields the port."""
    config = config if config is not None else ServeConfig(port=0)
    server, _ = _ingress_server(app, config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), "uvicorn did not start"
        await asyncio.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


@contextlib.contextmanager
def served_deployment(config: ServeConfig) -> Iterator[tuple[Deployment, str]]:
    """`config`'s deployment and its ingress, served on a thread as `k3serve serve` serves them; yields the
    deployment and the ingress's base URL, and shuts both down on exit."""
    deployment = start_deployment(config)
    server, _ = _ingress_server(build_app(deployment.client, deployment.metrics), config)
    thread = threading.Thread(target=server.run, name="ingress", daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            time.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield deployment, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        deployment.shutdown()
