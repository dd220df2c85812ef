"""Requests cut by the drain timeout (`k3serve serve` on SIGTERM: cluster/serve.py `_GracefulStop`,
cluster/api/drain.py) are aborted on the engines, not just ended for their clients: by the time the
server's event loop ends (then `run` shuts the workers down), every engine request has been aborted, and
the engines come back to no request, no MLA block, no KDA slot (nor a prefill pin or decode reservation).

A long stream and a long non-streaming completion (or the latter alone: then no stream keeps the loop
up while its abort runs) are in flight on the ingress `run` serves (`serve._ingress_server`, the real
uvicorn server and graceful stop, driven in `asyncio.run` as `run` does) when SIGTERM's handler runs; the
drain times out; the stream ends with an error event and [DONE], the plain request with the 503 OpenAI
error (not a hang, not a 500), both at once rather than after their tokens. The ingress's /metrics then counts
each cut request once, as a 503 (not the stream as a 499, client gone, nor the plain one not at all). The engines'
state is read directly (in colocated mode nothing feeds the pool gauges; the workers' stats are what the router's
gauges show). Colocated (a real AsyncEngine) and the local 1P1D router (real in-process workers, transfer "local")."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from k3serve.cluster.api import build_app
from k3serve.cluster.config import ServeConfig
from k3serve.cluster.serve import _ingress_server, _router
from k3serve.decode.worker import DecodeWorker
from k3serve.prefill.worker import PrefillWorker

from _api_harness import EngineAdapter, pool_usage
from test_decode_feed import workers  # noqa: F401  (one prefill, one decode worker; transfer "local")

pytestmark = pytest.mark.timeout(60)

DRAIN_S = 0.3
LONG = {"prompt": "Return a new dictionary with the keys", "max_tokens": 480, "ignore_eos": True,
        "temperature": 0.0}  # ~3 s of decoding here (more under load): only an abort ends it within FREED_WITHIN_S
FREED_WITHIN_S = 1.0  # the engine thread applies the aborts queued before the loop ended at its next step
IN_FLIGHT = {"stream+plain": (True, True), "plain-alone": (False, True)}


class _Cut:
    """What the clients of the cut requests got, and how long after the signal."""

    def __init__(self) -> None:
        self.stream_events: list[str] = []
        self.plain: httpx.Response | None = None
        self.seconds = 0.0
        self.metrics_text = ""  # /metrics once the server stopped


def _serve_and_drain(app: Any, stream: bool, plain: bool, running: Callable[[int], Awaitable[bool]]) -> _Cut:
    """Serve `app` as `run` does; once the requests asked for (a long stream, a long plain completion) are in
    flight and `running(n)` says the engine runs n requests, run SIGTERM's handler with a drain timeout of DRAIN_S;
    return once the event loop has ended."""
    cut = _Cut()

    async def main() -> None:
        server, stop = _ingress_server(app, ServeConfig(port=0, drain_timeout_seconds=DRAIN_S))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            assert not serving.done(), "uvicorn did not start"
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            async def read_stream() -> None:
                async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            cut.stream_events.append(line.removeprefix("data: "))

            async def post_plain() -> None:
                cut.plain = await http.post("/v1/completions", json=LONG)

            clients = [asyncio.create_task(c()) for c, wanted in ((read_stream, stream), (post_plain, plain)) if wanted]
            n = len(clients)
            while not (app.state.drain.in_flight == n and (cut.stream_events or not stream) and await running(n)):
                assert not any(c.done() for c in clients), [c.result() for c in clients if c.done()]
                await asyncio.sleep(0.01)
            signalled = time.monotonic()
            stop.on_signal("SIGTERM")
            await serving
            await asyncio.gather(*clients)
            cut.seconds = time.monotonic() - signalled
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as http:
            cut.metrics_text = (await http.get("/metrics")).text  # the route Prometheus scrapes, open while draining

    asyncio.run(main())  # as `run`: the tasks left are cancelled, the loop closed; the workers shut down next
    return cut


def _assert_clients_got_a_clear_end(cut: _Cut, stream: bool, plain: bool) -> None:
    assert cut.seconds < DRAIN_S + 3.0  # not the 480 tokens
    if stream:
        assert cut.stream_events[-1] == "[DONE]"
        error = json.loads(cut.stream_events[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
    if plain:
        assert cut.plain.status_code == 503, cut.plain.text
        error = cut.plain.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == 503 and "shutting down" in error["message"]


def _request_outcomes(metrics_text: str) -> dict[str, float]:
    """The requests the Prometheus text counts, by outcome: "error <status>", "success <finish reason>"."""
    outcomes = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "k3serve:request_errors_total":
                outcomes[f"error {sample.labels['status']}"] = sample.value
            elif sample.name == "vllm:request_success_total":
                outcomes[f"success {sample.labels['finished_reason']}"] = sample.value
    return outcomes


def _assert_each_cut_counted_once_as_503(cut: _Cut, stream: bool, plain: bool) -> None:
    assert _request_outcomes(cut.metrics_text) == {"error 503": stream + plain}


def _until_idle(held: Callable[[], object], what: str) -> None:
    """Until `held()` is None (nothing held); fails with what it still holds after FREED_WITHIN_S."""
    deadline = time.monotonic() + FREED_WITHIN_S
    while (state := held()) is not None:
        assert time.monotonic() < deadline, f"{what} still holds {state} {FREED_WITHIN_S} s after the drain"
        time.sleep(0.02)


@pytest.mark.parametrize("stream, plain", IN_FLIGHT.values(), ids=IN_FLIGHT.keys())
def test_colocated_requests_cut_by_the_drain_timeout_are_aborted_and_free_the_engine(
    client: EngineAdapter, metrics, stream: bool, plain: bool
) -> None:
    engine = client.engine

    async def running(n: int) -> bool:
        return pool_usage(engine)[1] == n  # each running request holds a KDA slot

    cut = _serve_and_drain(build_app(client, metrics), stream, plain, running)
    assert len(client.aborted) == stream + plain  # each engine request aborted before the loop ended
    _assert_clients_got_a_clear_end(cut, stream, plain)
    _assert_each_cut_counted_once_as_503(cut, stream, plain)
    _until_idle(lambda: None if pool_usage(engine) == (0, 0) and not engine.engine.has_unfinished()
                else pool_usage(engine), "the engine: (MLA blocks, KDA slots)")


def _held(worker: PrefillWorker | DecodeWorker) -> tuple | None:
    """(running, waiting, reserved, block usage, slot usage) of the worker's engine (the values of its pool gauges;
    pins and reservations count in the usage); None when all are 0."""
    s = asyncio.run(worker.stats())
    held = (s.num_running, s.num_waiting, s.num_reserved, s.block_usage, s.slot_usage)
    return None if held == (0, 0, 0, 0.0, 0.0) else held


@pytest.mark.parametrize("stream, plain", IN_FLIGHT.values(), ids=IN_FLIGHT.keys())
def test_1p1d_requests_cut_by_the_drain_timeout_are_aborted_on_both_workers(
    workers: tuple[PrefillWorker, DecodeWorker], tiny_checkpoint: Path, stream: bool, plain: bool  # noqa: F811
) -> None:
    prefill, decode = workers
    router, metrics = _router(ServeConfig(mode="disaggregated"), [prefill], [decode], str(tiny_checkpoint), "k3-tiny")

    async def running(n: int) -> bool:
        return (await decode.stats()).num_running == n

    cut = _serve_and_drain(build_app(router, metrics), stream, plain, running)
    _assert_clients_got_a_clear_end(cut, stream, plain)
    _assert_each_cut_counted_once_as_503(cut, stream, plain)
    _until_idle(lambda: _held(decode), "the decode worker")
    _until_idle(lambda: _held(prefill), "the prefill worker")


def test_a_cancelled_request_lets_its_work_clean_up_before_it_ends() -> None:
    """The drain cancels a request's handler; the work it waits on (whose cleanup aborts the engine request) must
    finish its cleanup before the handler's cancellation goes on: the loop may end right after it."""
    from k3serve.cluster.api.app import _unless_disconnected

    class SilentClient:  # the ASGI receive of a client that never disconnects
        async def receive(self) -> dict:
            await asyncio.Event().wait()
            return {}

    cleaned = []

    async def work() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.2)  # an abort that takes a round trip
            cleaned.append(True)

    async def main() -> None:
        handler = asyncio.ensure_future(_unless_disconnected(SilentClient(), work()))
        await asyncio.sleep(0.05)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        assert cleaned == [True]

    asyncio.run(main())
