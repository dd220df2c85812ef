"""What one client may send the ingress (issue 27): no request's size stalls the others, each bound is named in
its error, and text that is not valid Unicode is a 400 naming its field. Over the real app and a real AsyncEngine
on the tiny model (max_model_len 512; its longest token has 28 bytes, so at most 14336 characters can fit)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from k3serve.cluster.api import build_app
from k3serve.cluster.config import ServeConfig
from k3serve.cluster.ingress_limits import IngressLimits
from k3serve.cluster.metrics import IngressMetrics

from _api_harness import serve_ingress
from test_api import CHAT, HI, PROMPT, assert_error

pytestmark = pytest.mark.anyio

JSON = {"content-type": "application/json"}


def raw_json(payload: dict) -> bytes:
    """The payload as JSON text with \\uXXXX escapes (httpx's json= cannot encode a lone surrogate)."""
    return json.dumps(payload).encode()


def words(num_chars: int) -> str:
    """Text of about `num_chars` characters that tokenizes as prose does (a few characters a token)."""
    text = "the queue returns a new dictionary of values "
    return (text * (num_chars // len(text) + 1))[:num_chars]


# ---- body size ----------------------------------------------------------------------------------
@pytest.fixture
async def small_body_http(client):
    """The app with max_request_body_bytes 4096."""
    app = build_app(client, IngressMetrics(CollectorRegistry(), model_name=client.model_name),
                    limits=IngressLimits(max_request_body_bytes=4096))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as h:
        h.app_metrics = app.state.metrics
        yield h


async def test_body_over_the_limit_is_413_naming_it(small_body_http, client):
    payload = {"prompt": "x" * 5000, "max_tokens": 2}
    error = assert_error(await small_body_http.post("/v1/completions", json=payload), 413,
                         message="max_request_body_bytes (4096)")
    assert "announces" in error["message"]  # refused on its Content-Length, unread

    async def chunks():  # no Content-Length: counted as it arrives, refused at the chunk beyond the limit
        body = raw_json(payload)
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    r = await small_body_http.post("/v1/completions", content=chunks(), headers=JSON)
    assert_error(r, 413, message="has more than 4096 bytes")
    assert small_body_http.app_metrics.errors.labels(client.model_name, "413")._value.get() == 2
    ok = await small_body_http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


async def test_body_limit_comes_from_the_serve_config():
    config = ServeConfig(max_request_body_bytes=1000, max_stop_sequences=3)
    assert config.ingress_limits() == IngressLimits(max_request_body_bytes=1000, max_stop_sequences=3)
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        ServeConfig(max_request_body_bytes=0)


# ---- per-request bounds, named ------------------------------------------------------------------
LIMITED = {  # id: (route, payload, param, the limit the message names)
    "stop-10k-strings": (CHAT, {"messages": HI, "stop": ["a long stop string"] * 10_000}, "stop",
                         "more than max_stop_sequences (32)"),
    "stop-string-too-long": ("/v1/completions", {"prompt": PROMPT, "stop": ["ok", "y" * 257]}, "stop",
                             "stop string 1 has 257 characters, more than max_stop_sequence_chars (256)"),
    "stop_token_ids-33": ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": list(range(33))}, "stop_token_ids",
                          "33 ids, more than max_stop_sequences (32)"),
    "logit_bias-entries": (CHAT, {"messages": HI, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias",
                           "1025 entries, more than max_logit_bias_entries (1024)"),
    "prompt-over-context-chars": ("/v1/completions", {"prompt": words(14337)}, "prompt", "max_prompt_chars"),
    "batch-prompt-over-context-chars": ("/v1/completions", {"prompt": [PROMPT, words(20_000)]}, "prompt",
                                        "max_prompt_chars"),
    "tool-arguments-over-context-chars": (CHAT, {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "functions.f:0", "type": "function",
                                              "function": {"name": "f", "arguments": words(15_000)}}]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "done"}]}, "messages", "max_prompt_chars"),
}


@pytest.mark.parametrize("route,payload,param,names", LIMITED.values(), ids=LIMITED.keys())
async def test_a_request_over_a_limit_is_400_naming_the_limit(http, route, payload, param, names):
    assert_error(await http.post(route, json=payload), 400, param=param, message=names)


async def test_requests_at_the_limits_are_served(client):
    """At every limit (logit_bias's lowered to the tiny model's 512 ids) the request is served; a prompt of exactly
    max_prompt_chars passes the character bound and meets the exact check, in tokens."""
    app = build_app(client, IngressMetrics(CollectorRegistry(), model_name=client.model_name),
                    limits=IngressLimits(max_logit_bias_entries=512))
    at_limits = {"messages": HI, "max_tokens": 2, "stop": ["z" * 256] * 32, "stop_token_ids": list(range(32)),
                 "logit_bias": {str(i): 0.5 for i in range(512)}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as h:
        r = await h.post(CHAT, json=at_limits)
        assert r.status_code == 200, r.text
        r = await h.post(CHAT, json={**at_limits, "messages": [{"role": "user", "content": words(14336)}]})
    assert_error(r, 400, param="messages", message="maximum context length is 512 tokens. However, you requested")


# ---- invalid Unicode ----------------------------------------------------------------------------
LONE = "ok \ud800 there"  # json.dumps writes it as the escape "\ud800"
TOOL = {"type": "function", "function": {"name": "lookup", "description": "find a word",
                                         "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}
SURROGATES = {  # id: (route, payload, param, the path the message names)
    "message-content": (CHAT, {"messages": [{"role": "user", "content": LONE}]}, "messages", "messages.0.content"),
    "content-part": (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                      {"type": "text", "text": LONE}]}]},
                     "messages", "messages.0.content.1.text"),
    "system-name": (CHAT, {"messages": [{"role": "system", "content": "be brief", "name": LONE}, *HI]}, "messages",
                    "messages.0.name"),
    "prompt": ("/v1/completions", {"prompt": LONE}, "prompt", "prompt"),
    "batch-prompt": ("/v1/completions", {"prompt": ["fine", LONE]}, "prompt", "prompt.1"),
    "stop": (CHAT, {"messages": HI, "stop": ["fine", LONE]}, "stop", "stop.1"),
    "tool-description": (CHAT, {"messages": HI, "tools": [{**TOOL, "function": {**TOOL["function"],
                                                                               "description": LONE}}]},
                         "tools", "tools.0.function.description"),
    "tool-parameters-key": (CHAT, {"messages": HI, "tools": [{**TOOL, "function": {
        **TOOL["function"], "parameters": {"type": "object", "properties": {LONE: {"type": "string"}}}}}]},
        "tools", "tools.0.function.parameters.properties"),
    "tool-call-arguments": (CHAT, {"messages": [*HI, {"role": "assistant", "tool_calls": [
        {"id": "functions.lookup:0", "type": "function",
         "function": {"name": "lookup", "arguments": '{"word": "' + LONE + '"}'}}]}]},
        "messages", "messages.1.tool_calls.0.function.arguments"),
    "logit_bias-key": (CHAT, {"messages": HI, "logit_bias": {LONE: 1}}, "logit_bias", "logit_bias"),
    "guided_choice": ("/v1/completions", {"prompt": PROMPT, "guided_choice": ["yes", LONE]}, "guided_choice",
                      "guided_choice.1"),
}


@pytest.mark.parametrize("route,payload,param,path", SURROGATES.values(), ids=SURROGATES.keys())
async def test_a_lone_surrogate_anywhere_is_400_naming_the_field(http, route, payload, param, path):
    assert "\\ud800" in raw_json(payload).decode()
    r = await http.post(route, content=raw_json(payload), headers=JSON)
    error = assert_error(r, 400, param=param, message="lone surrogate (U+D800)")
    assert error["message"].startswith(f"{path}: "), error["message"]


async def test_surrogates_as_utf8_bytes_and_invalid_utf8_are_400(http):
    """Python's JSON decoder lets UTF-8-encoded surrogates through (as "\\ud800" escapes); bytes that are not UTF-8
    at all fail to parse."""
    body = b'{"messages": [{"role": "user", "content": "ok \xed\xa0\x80"}]}'
    assert_error(await http.post(CHAT, content=body, headers=JSON), 400, param="messages",
                 message="lone surrogate (U+D800)")
    assert_error(await http.post(CHAT, content=b'{"messages": [{"role": "user", "content": "\xff"}]}', headers=JSON),
                 400)


async def test_a_surrogate_pair_is_valid_text(http):
    """An escaped pair is one character (U+1F600), served as any other."""
    payload = {"messages": [{"role": "user", "content": "smile \U0001F600"}], "max_tokens": 2}
    assert "\\ud83d\\ude00" in raw_json(payload).decode()
    r = await http.post(CHAT, content=raw_json(payload), headers=JSON)
    assert r.status_code == 200, r.text


# ---- large prompts do not stall the others --------------------------------------------------------
CANARY = {"messages": HI, "max_tokens": 2, "temperature": 0.0}


async def _canaries_during(port: int, big: dict) -> tuple[httpx.Response, float, list[float]]:
    """POST `big` and, until it is answered, canary chats one after another, each over its own connection;
    (the big one's response, its seconds, each canary's seconds). Every canary must succeed. The client shares the
    server's event loop: a loop stalled while a canary is in flight shows in that canary's time."""
    async def timed(h: httpx.AsyncClient, payload: dict) -> tuple[httpx.Response, float]:
        start = time.monotonic()
        r = await h.post(CHAT, json=payload)
        return r, time.monotonic() - start

    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url, timeout=60) as big_client:
        big_task = asyncio.create_task(timed(big_client, big))
        canary_s = []
        while not big_task.done():
            async with httpx.AsyncClient(base_url=url, timeout=60) as h:
                canary, seconds = await timed(h, CANARY)
            assert canary.status_code == 200, canary.text
            canary_s.append(seconds)
        big_response, big_s = await big_task
    return big_response, big_s, canary_s


async def test_a_10_mb_prompt_is_refused_at_once_and_stalls_no_one(app):
    """10 MB cannot fit 512 tokens: it is refused on its length, before the chat template or the tokenizer (which
    take seconds over it), and the canaries sent meanwhile are served."""
    async with serve_ingress(app) as port:
        big = {"messages": [{"role": "user", "content": words(10 * 2**20)}], "max_tokens": 2}
        r, big_s, canary_s = await _canaries_during(port, big)
    assert_error(r, 400, param="messages", message="max_prompt_chars")
    assert big_s < 3.0, big_s  # reading and parsing 10 MB; tokenizing it takes several seconds
    assert max(canary_s) < 3.0, canary_s


async def test_a_prompt_that_fits_is_tokenized_off_the_event_loop(client, metrics):
    """Behind a long context (2**20 tokens, as the ingress sees it; the engine keeps its 512) a 1 MB prompt fits the
    character bound and is tokenized, which takes a second or more: on a worker thread, so the canaries sent
    meanwhile are each served in a fraction of that. (On the loop, the canary in flight would wait out the whole
    tokenization.) The engine then refuses the prompt's 350k tokens."""
    client.max_model_len = 2**20
    app = build_app(client, metrics)
    async with serve_ingress(app) as port:
        big = {"messages": [{"role": "user", "content": words(2**20)}], "max_tokens": 2}
        r, big_s, canary_s = await _canaries_during(port, big)
    assert_error(r, 400)  # the engine's context check, after the tokenization
    assert big_s > 0.3, f"the big request took {big_s:.2f} s: too short to show a stall"
    assert len(canary_s) >= 3 and max(canary_s) < big_s / 2, (big_s, canary_s)
