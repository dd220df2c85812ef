"""Faults against a real disaggregated server (Ray, Mooncake): every request either succeeds or gets
a clean OpenAI error, nothing hangs, the pools recover, and nothing stays allocated.

    kill a prefill replica mid-burst   -> retried on the other replica, or a clean 503; later OK
    kill the decode replica mid-burst  -> clean errors; Ray restarts it; later requests succeed
    client disconnects mid-stream      -> blocks and slots back to zero on both pools
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from _server_harness import Server, ServerSpec, serve

PROMPT = "Tell me a long story about the sea and the ships that sail on it, " * 4


def _complete(server: Server, max_tokens: int = 48, timeout: float = 60.0) -> int:
    """HTTP status of one greedy completion (the body is checked for an OpenAI error on failure)."""
    resp = httpx.post(f"{server.url}/v1/completions", timeout=timeout, json={
        "model": server.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    if resp.status_code != 200:
        assert "error" in resp.json() and resp.json()["error"]["message"], resp.text
    return resp.status_code


def _wait_until(predicate, deadline_s: float, what: str) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")


def _all_pools_idle(server: Server) -> bool:
    usage = {**server.gauge("k3serve:kv_block_usage_ratio"), **server.gauge("k3serve:kda_slot_usage_ratio")}
    running = server.gauge("k3serve:num_requests_running")
    return bool(usage) and all(v == 0 for v in usage.values()) and all(v == 0 for v in running.values())


@pytest.fixture(scope="module")
def two_prefill_server(tiny_checkpoint: Path, artifacts_dir: Path):
    yield from serve(ServerSpec(prefill_replicas=2), tiny_checkpoint, artifacts_dir, "faults")


@pytest.mark.timeout(240)
def test_killed_prefill_replica_is_retried_or_fails_cleanly(two_prefill_server: Server) -> None:
    server = two_prefill_server
    assert _complete(server) == 200
    victims = server.actor_pids("PrefillActor")
    assert len(victims) == 2, victims
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_complete, server) for _ in range(8)]
        time.sleep(0.3)
        os.kill(victims[0], signal.SIGKILL)
        statuses = [f.result(timeout=90) for f in futures]
    assert set(statuses) <= {200, 503}, statuses
    _wait_until(lambda: _complete(server, max_tokens=4) == 200, 60, "requests to succeed again")
    assert all(_complete(server, max_tokens=4) == 200 for _ in range(4))


@pytest.mark.timeout(240)
def test_killed_decode_replica_errors_cleanly_and_restarts(disagg_server: Server) -> None:
    server = disagg_server
    assert _complete(server) == 200
    (victim,) = server.actor_pids("DecodeActor")
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_complete, server, 96) for _ in range(6)]
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        statuses = [f.result(timeout=90) for f in futures]
    assert set(statuses) <= {200, 503}, statuses
    assert 503 in statuses or all(s == 200 for s in statuses)
    _wait_until(lambda: _complete(server, max_tokens=4) == 200, 90, "the restarted decode replica to serve")
    assert server.actor_pids("DecodeActor") != [victim]


@pytest.mark.timeout(120)
def test_client_disconnect_frees_both_pools(disagg_server: Server) -> None:
    server = disagg_server
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(3):  # a few tokens in, then hang up
            next(lines)
    _wait_until(lambda: _all_pools_idle(server), 20, "blocks and slots to return to zero on both pools")
