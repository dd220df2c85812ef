"""The uvicorn server `k3serve serve` runs bounds its connections before they are requests (issue 27: 200
connections sending their headers slowly were held for 46 s): a cap on open connections, a header timeout, a
header size; each refusal is OpenAI's error JSON naming its limit, then the connection is closed. Driven over raw
sockets against the real server and app."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from k3serve.cluster.config import ServeConfig

from _api_harness import serve_ingress

pytestmark = pytest.mark.anyio

LIMITS = dict(header_timeout_seconds=1.0, keep_alive_timeout_seconds=0.3, max_connections=3, max_header_bytes=2048)
HEALTH = b"GET /health HTTP/1.1\r\nHost: ingress\r\n\r\n"


@pytest.fixture
async def port(app):
    async with serve_ingress(app, ServeConfig(port=0, **LIMITS)) as port:
        yield port


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def read_to_close(reader: asyncio.StreamReader, within_s: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), within_s)


def refusal(raw: bytes, status: int) -> str:
    """The error message of a `status` response that closes the connection."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw[:200]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == status and set(error) == {"message", "type", "param", "code"}
    return error["message"]


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One response without a body (/health's), read off a connection that stays open."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert b"content-length: 0" in head.lower(), head
    return head


async def test_slow_headers_get_408_at_the_header_timeout(port):
    reader, writer = await connect(port)
    start = time.monotonic()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: ingress\r\n")  # and then nothing more
    raw = await read_to_close(reader)
    waited = time.monotonic() - start
    assert "header_timeout_seconds (1)" in refusal(raw, 408)
    assert 0.9 < waited < 3.0, waited
    writer.close()


async def test_a_keep_alive_connection_is_idle_for_keep_alive_timeout_then_timed_for_its_next_headers(port):
    reader, writer = await connect(port)
    writer.write(HEALTH)
    assert (await read_response(reader)).startswith(b"HTTP/1.1 200 ")
    start = time.monotonic()
    assert await read_to_close(reader) == b""  # idle: closed after keep_alive_timeout_seconds, nothing sent
    assert time.monotonic() - start < 0.9

    reader, writer = await connect(port)
    writer.write(HEALTH)
    await read_response(reader)
    writer.write(b"GET /health HTTP/1.1\r\nHo")  # the next request's headers begin (the idle timer stops) ...
    assert "header_timeout_seconds" in refusal(await read_to_close(reader), 408)  # ... and never end


async def test_a_connection_over_max_connections_gets_503_at_once(port):
    held = [await connect(port) for _ in range(3)]
    await asyncio.sleep(0.05)  # accepted
    reader, writer = await connect(port)
    start = time.monotonic()
    assert "max_connections (3)" in refusal(await read_to_close(reader), 503)
    assert time.monotonic() - start < 0.5  # not after the held ones' header timeout
    _, first = held.pop(0)
    first.close()
    await asyncio.sleep(0.05)
    reader, writer = await connect(port)  # room again
    writer.write(HEALTH)
    assert (await read_response(reader)).startswith(b"HTTP/1.1 200 ")
    for _, w in [*held, (reader, writer)]:
        w.close()


async def test_headers_over_max_header_bytes_get_431(port):
    reader, writer = await connect(port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: ingress\r\nX-Padding: " + b"a" * 3000)
    assert "max_header_bytes (2048)" in refusal(await read_to_close(reader), 431)
    reader, writer = await connect(port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: ingress\r\nX-Padding: " + b"a" * 1500 + b"\r\n\r\n")
    assert (await read_response(reader)).startswith(b"HTTP/1.1 200 ")  # within the limit
    writer.close()
