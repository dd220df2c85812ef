"""Ingress test harness: a real AsyncEngine on the tiny model behind the OpenAI app.

    engine      AsyncEngine(block_size=16, max_model_len=512, max_num_seqs=8, 64 MiB cache); shut
                down after the test, which must leave no MLA block or KDA slot in use
    client      EngineAdapter: the engine as an EngineClient, with fault switches
                (fail_with: raised before any delta; fail_after_first: raised after the first
                delta; unhealthy: check_health raises)
    metrics     IngressMetrics on a fresh registry, one (decode, 0) replica
    http        httpx.AsyncClient over ASGITransport (in-process, responses fully buffered)
    server_url  the same app behind a real uvicorn server on an ephemeral port

`tiny_checkpoint` comes from tests/conftest.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from k3serve.cluster.api import build_app
from k3serve.cluster.metrics import IngressMetrics
from k3serve.engine.async_engine import AsyncEngine

from _api_harness import ENGINE_ARGS, EngineAdapter, pool_usage


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(tiny_checkpoint: Path):
    engine = AsyncEngine(model=str(tiny_checkpoint), **ENGINE_ARGS)
    yield engine
    engine.shutdown()  # commands run in order: every abort queued before this is applied
    assert engine._error is None, f"the engine thread failed: {engine._error!r}"
    assert pool_usage(engine) == (0, 0), f"(blocks, slots) still in use: {pool_usage(engine)}"


@pytest.fixture
def client(engine: AsyncEngine) -> EngineAdapter:
    return EngineAdapter(engine)


@pytest.fixture
def metrics(client: EngineAdapter) -> IngressMetrics:
    return IngressMetrics(CollectorRegistry(), model_name=client.model_name, pools=[("decode", "0")])


@pytest.fixture
def app(client: EngineAdapter, metrics: IngressMetrics):
    return build_app(client, metrics)


@pytest.fixture
async def http(app) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as c:
        yield c


@pytest.fixture
async def server_url(app) -> AsyncIterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await asyncio.wait_for(task, 10)
