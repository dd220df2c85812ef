"""Bad requests to the disaggregated server get a clear 4xx OpenAI error, never a 500 or a hang."""

from __future__ import annotations

import httpx
import pytest

from _server_harness import Server

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error"}


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    """`{"error": {"message", "type", "param", "code"}}` with this status; returns the error."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["code"] == status and error["type"] == ERROR_TYPES[status] and error["message"], error
    return error


CASES = {
    "unknown model": ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404),
    "negative max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    "prompt longer than the context": ("/v1/completions", {"prompt": "word " * 5000, "max_tokens": 4}, 400),
    "wrong type": ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    "messages of the wrong type": ("/v1/chat/completions", {"messages": "hi", "max_tokens": 4}, 400),
    "prompt of the wrong type": ("/v1/completions", {"prompt": {"text": "hi"}, "max_tokens": 4}, 400),
    "temperature out of range": ("/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "hi"}], "temperature": -3}, 400),
    "messages missing": ("/v1/chat/completions", {"max_tokens": 4}, 400),
    "unsupported content part": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_gets_an_openai_error(disagg_server: Server, case: str) -> None:
    path, body, status = CASES[case]
    body = {"model": disagg_server.model, **body}
    assert_openai_error(httpx.post(f"{disagg_server.url}{path}", json=body, timeout=30), status)


@pytest.mark.timeout(60)
def test_malformed_json_is_400(disagg_server: Server) -> None:
    resp = httpx.post(f"{disagg_server.url}/v1/completions", content=b'{"prompt": "hi",',
                      headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(resp, 400)


@pytest.mark.timeout(60)
def test_server_still_serves_after_bad_requests(disagg_server: Server) -> None:
    resp = httpx.post(f"{disagg_server.url}/v1/completions", timeout=30,
                      json={"model": disagg_server.model, "prompt": "hi", "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4
