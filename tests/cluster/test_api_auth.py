"""The ingress's API key (cluster/api/auth.py, `build_app(api_key=...)`), as vLLM's `--api-key`: every /v1
route wants `Authorization: Bearer <key>` and answers anything else with a 401 OpenAI error before the request
reaches the engine; /health and /metrics stay open; without a key everything is open. The key shows in no
answer and no log line. A real AsyncEngine on the tiny model serves behind it (conftest.py); its
`fail_with` switch turns any request that would reach it into a 500, so a 401 proves it never did."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from k3serve.cluster.api import build_app
from k3serve.cluster.status import print_status

from test_api import assert_error, parse_sse

pytestmark = pytest.mark.anyio

KEY = "k3-test-key-0123456789abcdef"
HI = [{"role": "user", "content": "hi"}]
SHORT = {"max_tokens": 2, "temperature": 0.0}
ROUTES = {
    "models": ("GET", "/v1/models", None),
    "completions": ("POST", "/v1/completions", {"prompt": "hello", **SHORT}),
    "completions-stream": ("POST", "/v1/completions", {"prompt": "hello", "stream": True, **SHORT}),
    "chat": ("POST", "/v1/chat/completions", {"messages": HI, **SHORT}),
    "chat-stream": ("POST", "/v1/chat/completions", {"messages": HI, "stream": True, **SHORT}),
}
WRONG = {
    "none": {},
    "wrong-key": {"Authorization": "Bearer wrong"},
    "key-prefix": {"Authorization": f"Bearer {KEY[:-1]}"},
    "key-without-scheme": {"Authorization": KEY},
    "basic-scheme": {"Authorization": f"Basic {KEY}"},
}


@pytest.fixture
def app(client, metrics):
    return build_app(client, metrics, api_key=KEY)


async def call(http: httpx.AsyncClient, route: str, headers: dict[str, str]) -> httpx.Response:
    method, path, body = ROUTES[route]
    return await http.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("route", ROUTES)
async def test_a_missing_or_wrong_key_is_401_and_never_reaches_the_engine(http, client, metrics, route, caplog):
    client.fail_with = AssertionError("the engine got a request")  # reaching it would answer 500
    caplog.set_level(logging.DEBUG)
    for name, headers in WRONG.items():
        response = await call(http, route, headers)
        error = assert_error(response, 401)
        assert error["type"] == "authentication_error", name
        assert response.headers["www-authenticate"] == "Bearer"
        assert KEY not in response.text and KEY[:-1] not in response.text
    assert metrics.errors.labels(client.model_name, "401")._value.get() == len(WRONG)
    assert metrics.success.labels(*metrics.vllm_labels, "length")._value.get() == 0
    assert KEY[:-1] not in caplog.text


async def test_the_key_is_checked_before_the_body(http, client):
    """A refused request's body is never parsed: bad JSON without the key is 401, not 400."""
    response = await http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_error(response, 401)
    response = await http.post("/v1/completions", content=b"{not json",
                               headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert_error(response, 400)


@pytest.mark.parametrize("route", ROUTES)
async def test_the_right_key_is_served(http, client, route, caplog):
    caplog.set_level(logging.DEBUG)
    response = await call(http, route, {"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    if route == "models":
        assert [m["id"] for m in response.json()["data"]] == [client.model_name]
    elif route.endswith("-stream"):
        assert parse_sse(response.text)
    else:
        assert response.json()["usage"]["completion_tokens"] == 2
    assert KEY not in caplog.text


async def test_the_scheme_is_case_insensitive(http):
    assert (await http.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})).status_code == 200


async def test_health_and_metrics_stay_open(http, client):
    assert (await http.get("/health")).status_code == 200
    await http.get("/v1/models")
    metrics = await http.get("/metrics")
    assert metrics.status_code == 200
    assert f'k3serve:request_errors_total{{model_name="{client.model_name}",status="401"}} 1.0' in metrics.text


def test_an_empty_key_is_refused(client):
    with pytest.raises(ValueError, match="api_key is empty"):
        build_app(client, api_key="")


async def test_without_a_key_everything_is_open(client, metrics):
    """As before keys existed; the OpenAI SDK's placeholder key (api_key="none") is no obstacle."""
    app = build_app(client, metrics)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as http:
        for headers in ({}, {"Authorization": "Bearer none"}):
            for route in ("models", "completions"):
                assert (await call(http, route, headers)).status_code == 200


async def test_status_sends_the_key(server_url, client, capsys):
    assert await asyncio.to_thread(print_status, server_url, KEY) == 0
    assert f"healthy; models: {client.model_name}\n" in capsys.readouterr().out
    assert await asyncio.to_thread(print_status, server_url) == 0  # /health still answers
    out = capsys.readouterr().out
    assert "models: ? (401: give the server's key" in out and KEY not in out
