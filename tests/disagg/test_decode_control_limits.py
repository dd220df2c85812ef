"""Specification of what a decode worker grants over its control plane (decode/worker.py): a real DecodeWorker on
the tiny model, its real gRPC server, real clients.

    no secret                          -> refused everything (UNAUTHENTICATED), nothing reserved
    the secret, no reservation         -> Handshake refused: no region, no address learned
    the secret, a live reservation     -> Handshake answers the regions (the one way a writer learns them)
    a Reserve flood from one peer host -> refused past max_reservations_per_peer; the router's admissions still go
    num_tokens > max_model_len, a lease above lease_seconds, NaN / negative / inf leases -> INVALID_ARGUMENT
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from k3serve.decode.worker import DecodeWorker
from k3serve.engine.config import EngineArgs
from k3serve.engine.sampling_params import SamplingParams
from k3serve.transfer.auth import ControlAuth, new_secret
from k3serve.transfer.backend import AgentInfo
from k3serve.transfer.control import (
    DecodeControlClient,
    InvalidArgumentError,
    NoCapacityError,
    UnauthenticatedPeerError,
    UnknownRequestError,
)

pytestmark = pytest.mark.timeout(120)

SECRET = new_secret()
PER_PEER = 4
LEASE_S = 20.0


@pytest.fixture(scope="module")
def decode(tiny_checkpoint: Path):
    args = EngineArgs(model=str(tiny_checkpoint), block_size=16, max_model_len=512, cache_memory_bytes=64 << 20,
                      max_num_seqs=16)
    worker = DecodeWorker(args, control_auth=ControlAuth(SECRET), max_reservations_per_peer=PER_PEER, lease_seconds=LEASE_S)
    yield worker
    worker.shutdown()


@pytest.fixture
def client(decode: DecodeWorker):
    with DecodeControlClient(decode.control_address, decode.compat_hash, secret=SECRET) as client:
        yield client


def _handshake(client: DecodeControlClient, decode: DecodeWorker, request_id: str):
    """A handshake a real prefill rank of this model would send (its layout and regions look like decode's)."""
    agent = AgentInfo("local", "prefill-like", b"", tuple(decode.receiver.regions.values()))
    return client.handshake(agent, decode.receiver.layout.to_json(), 1, 0, request_id)


def _reserved(decode: DecodeWorker) -> int:
    return asyncio.run(decode.stats()).num_reserved


def test_a_peer_without_the_secret_is_refused_everything(decode: DecodeWorker) -> None:
    with DecodeControlClient(decode.control_address, decode.compat_hash, secret=new_secret()) as bogus:
        for call in (lambda: _handshake(bogus, decode, ""), lambda: bogus.reserve("flood-0", 16, 5.0),
                     lambda: bogus.heartbeat(["flood-0"], "bogus"), lambda: bogus.abort("flood-0", "x")):
            with pytest.raises(UnauthenticatedPeerError):
                call()
    assert _reserved(decode) == 0


def test_a_peer_with_the_secret_but_no_reservation_learns_no_region(decode: DecodeWorker,
                                                                   client: DecodeControlClient) -> None:
    for request_id in ("", "never-reserved"):
        with pytest.raises(UnknownRequestError, match="names no live reservation") as e:
            _handshake(client, decode, request_id)
        assert "0x" not in str(e.value) and decode.receiver.layout.compat_hash not in str(e.value)
    assert client.peer_instance_id == ""


def test_a_handshake_for_a_live_reservation_answers_the_regions(decode: DecodeWorker,
                                                                client: DecodeControlClient) -> None:
    client.reserve("granted", 32, 5.0)
    try:
        info = _handshake(client, decode, "granted")
        assert {r.name for r in info.agent.regions} == set(decode.receiver.regions)
    finally:
        client.abort("granted", "test over")
    with pytest.raises(UnknownRequestError):  # aborted: no longer a reason to show them
        _handshake(client, decode, "granted")


def test_a_reserve_flood_from_one_peer_stops_at_its_limit_and_the_router_still_admits(
        decode: DecodeWorker, client: DecodeControlClient) -> None:
    ids = [f"flood-{i}" for i in range(PER_PEER)]
    try:
        for request_id in ids:
            client.reserve(request_id, 16, 5.0)
        with pytest.raises(NoCapacityError, match=f"already holds {PER_PEER} reservations.*"
                                                  f"max_reservations_per_peer={PER_PEER}"):
            client.reserve("flood-over", 16, 5.0)

        async def admit_one() -> None:  # the router's path (a Ray call, not this control plane) is not capped
            await decode.admit("routed", list(range(3, 20)), SamplingParams(max_tokens=4))
            await decode.abort_request("routed")
        asyncio.run(admit_one())
        client.abort(ids[0], "make room")
        client.reserve("flood-again", 16, 5.0)  # one freed: one more fits
        ids[0] = "flood-again"
    finally:
        for request_id in ids:
            client.abort(request_id, "test over")
    assert _reserved(decode) == 0


@pytest.mark.parametrize("num_tokens, lease, why", [
    (0, 5.0, "num_tokens must be >= 1"),
    (513, 5.0, "num_tokens 513 exceeds this engine's max_model_len 512"),
    (16, math.nan, "lease_seconds must be finite"),
    (16, math.inf, "lease_seconds must be finite"),
    (16, -3.0, "lease_seconds must be finite and >= 0"),
    (16, LEASE_S + 1, f"lease_seconds {LEASE_S + 1:g} exceeds this decode's limit {LEASE_S:g}"),
], ids=["zero-tokens", "past-max-model-len", "nan-lease", "inf-lease", "negative-lease", "lease-above-limit"])
def test_reserve_refuses_what_the_engine_cannot_hold_or_release(decode: DecodeWorker, client: DecodeControlClient,
                                                                num_tokens: int, lease: float, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        client.reserve("bad", num_tokens, lease)
    assert _reserved(decode) == 0
