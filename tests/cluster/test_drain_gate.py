"""The drain's gate (cluster/api/drain.py) on a real uvicorn server (conftest.py `server_url`): while the ingress
drains a new request gets the 503 OpenAI error with `Connection: close`, and a request the drain's abort cuts
before any route took it (its body still arriving, so no request timer yet) gets that 503 too; each counts once
in k3serve:request_errors{status="503"}. (Requests cut inside a route: test_drain_frees_engines.py.)"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import httpx
import pytest

from test_api import assert_error

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

PARTIAL_BODY = b'{"prompt": "hel'  # of a declared 64 bytes: the rest never comes


def errors_by_status(metrics) -> dict[str, float]:
    return {sample.labels["status"]: sample.value for family in metrics.errors.collect()
            for sample in family.samples if sample.name.endswith("_total")}


async def test_a_new_request_while_draining_is_refused_with_503_and_closed(app, server_url, metrics):
    app.state.drain.begin()
    async with httpx.AsyncClient(base_url=server_url, timeout=10) as http:
        response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert_error(response, 503, message="shutting down")
    assert response.json()["error"]["type"] == "service_unavailable_error"
    assert response.headers["connection"] == "close"
    assert errors_by_status(metrics) == {"503": 1}


async def test_a_request_cut_while_its_body_arrives_gets_503_counted_once(app, server_url, metrics):
    address = urlsplit(server_url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: ingress\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 64\r\n\r\n" + PARTIAL_BODY)
    await writer.drain()
    drain = app.state.drain
    while drain.in_flight != 1:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # the route's body read under way
    drain.begin()
    await drain.abort(5.0)
    answer = await asyncio.wait_for(reader.read(), 5.0)  # to EOF: Connection: close
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert b"\r\nconnection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert drain.in_flight == 0
    assert errors_by_status(metrics) == {"503": 1}
