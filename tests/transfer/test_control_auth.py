"""Specification of the control plane's authentication and bounds (transfer/auth.py, transfer/control.py): a
real server on loopback, real clients (one holding the deployment's secret, bogus ones without it), a handler
that records every call it gets.

    bogus peer (no secret / a wrong one) --- any RPC ---> UNAUTHENTICATED, one fixed message; the handler never runs
    deployment peer (the secret)         --- Reserve(num_tokens=0 | lease NaN, inf, < 0) ---> INVALID_ARGUMENT
"""

from __future__ import annotations

import math
import time

import pytest

grpc = pytest.importorskip("grpc")

from k3serve.transfer.auth import METADATA_KEY, REFUSAL, SecretCheck, check_secret, new_secret  # noqa: E402
from k3serve.transfer.backend import AgentInfo, RegionDesc  # noqa: E402
from k3serve.transfer.control import (  # noqa: E402
    MAX_CHECKSUMS,
    MAX_HEARTBEAT_IDS,
    MAX_ID_CHARS,
    DecodeControlClient,
    DecodeControlServer,
    HandshakeInfo,
    InvalidArgumentError,
    Reservation,
    UnauthenticatedPeerError,
    peer_host,
)
from k3serve.transfer.proto import transfer_pb2 as pb  # noqa: E402
from k3serve.transfer.proto import transfer_pb2_grpc as pb_grpc  # noqa: E402

COMPAT = "compat-aaaa"
SECRET = new_secret()
DECODE_REGION = RegionDesc("mla.0", 0x7F00_DEAD_0000, 1 << 20, "cpu")
DECODE_AGENT = AgentInfo("local", "decode-0", b"", (DECODE_REGION,))
PREFILL_AGENT = AgentInfo("local", "prefill-0", b"", ())


class RecordingDecode:
    """Answers every RPC and records it: a refused call must leave `calls` empty."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def handshake(self, peer, layout_json, tp_size, tp_rank, request_id) -> HandshakeInfo:
        self.calls.append(("handshake", request_id))
        return HandshakeInfo(DECODE_AGENT, "{}", 1, 0)

    def reserve(self, request_id, num_tokens, lease_seconds, peer) -> Reservation:
        self.calls.append(("reserve", request_id, num_tokens, lease_seconds, peer))
        return Reservation((7,), 3, time.time() + 30)

    def transfer_ready(self, request_id, from_rank, first_token_id, num_tokens, checksums) -> None:
        self.calls.append(("transfer_ready", request_id))

    def abort(self, request_id, reason) -> None:
        self.calls.append(("abort", request_id))

    def heartbeat(self, request_ids, sender) -> list[str]:
        self.calls.append(("heartbeat",))
        return []


@pytest.fixture
def decode() -> RecordingDecode:
    return RecordingDecode()


@pytest.fixture
def server(decode: RecordingDecode):
    server = DecodeControlServer(decode, COMPAT, secret=SECRET).start()
    yield server
    server.stop(0)


@pytest.fixture
def client(server: DecodeControlServer):
    with DecodeControlClient(server.address, COMPAT, secret=SECRET) as client:
        yield client


def _every_rpc(stub: pb_grpc.DecodeControlStub) -> dict:
    return {
        "Handshake": lambda md: stub.Handshake(pb.HandshakeRequest(compat_hash=COMPAT, tp_size=1), timeout=2,
                                               metadata=md),
        "Reserve": lambda md: stub.Reserve(pb.ReserveRequest(request_id="r", num_tokens=1, lease_seconds=5),
                                           timeout=2, metadata=md),
        "TransferReady": lambda md: stub.TransferReady(pb.TransferReadyRequest(request_id="r"), timeout=2,
                                                       metadata=md),
        "Abort": lambda md: stub.Abort(pb.AbortRequest(request_id="r"), timeout=2, metadata=md),
        "Heartbeat": lambda md: stub.Heartbeat(pb.HeartbeatRequest(request_ids=["r"]), timeout=2, metadata=md),
    }


@pytest.mark.parametrize("metadata", [None, ((METADATA_KEY, "not-the-deployment-secret"),),
                                      ((METADATA_KEY, SECRET[:-1]),), (("authorization", SECRET),)],
                         ids=["no-secret", "wrong-secret", "truncated-secret", "secret-under-another-key"])
def test_a_bogus_peer_is_refused_every_rpc_and_learns_nothing(server: DecodeControlServer, decode: RecordingDecode,
                                                               metadata) -> None:
    with grpc.insecure_channel(server.address) as channel:
        for rpc, call in _every_rpc(pb_grpc.DecodeControlStub(channel)).items():
            with pytest.raises(grpc.RpcError) as e:
                call(metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, rpc
            assert e.value.details() == REFUSAL, rpc  # the same words whatever was asked
            leaked = [value for _, value in (e.value.trailing_metadata() or ())]
            assert not any(COMPAT in str(v) or server.instance_id in str(v) for v in leaked), rpc
    assert decode.calls == []  # nothing reached the handler: no reservation, no region, no hash


def test_a_client_with_a_wrong_secret_raises_unauthenticated_naming_the_server(server: DecodeControlServer,
                                                                              decode: RecordingDecode) -> None:
    with DecodeControlClient(server.address, COMPAT, secret=new_secret()) as bogus:
        with pytest.raises(UnauthenticatedPeerError, match=server.address):
            bogus.handshake(PREFILL_AGENT, "{}", 1, 0)
        with pytest.raises(UnauthenticatedPeerError):
            bogus.reserve("r", 1, 5.0)
    assert bogus.peer_instance_id == "" and decode.calls == []


def test_the_deployment_secret_passes_and_the_handshake_answers_in_full(client: DecodeControlClient,
                                                                       server: DecodeControlServer) -> None:
    info = client.handshake(PREFILL_AGENT, "{}", 1, 0)
    assert info.agent.regions == (DECODE_REGION,) and client.peer_instance_id == server.instance_id


def test_a_refused_handshake_carries_no_compat_hash_and_no_instance_id(server: DecodeControlServer) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.DecodeControlStub(channel)
        response = stub.Handshake(pb.HandshakeRequest(compat_hash="other", tp_size=1), timeout=2,
                                  metadata=((METADATA_KEY, SECRET),))
    assert not response.ok and response.code == pb.ERROR_CODE_INCOMPATIBLE
    assert response.compat_hash == "" and response.instance_id == "" and not response.agent.regions
    assert COMPAT not in response.error


@pytest.mark.parametrize("num_tokens, lease, why", [
    (0, 5.0, "num_tokens must be >= 1, got 0"),
    (1, math.nan, "lease_seconds must be finite"),
    (1, math.inf, "lease_seconds must be finite"),
    (1, -math.inf, "lease_seconds must be finite"),
    (1, -1.0, "lease_seconds must be finite and >= 0"),
], ids=["zero-tokens", "nan-lease", "inf-lease", "minus-inf-lease", "negative-lease"])
def test_reserve_refuses_bad_sizes_and_leases_before_the_handler(client: DecodeControlClient, decode: RecordingDecode,
                                                                 num_tokens: int, lease: float, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        client.reserve("r", num_tokens, lease)
    assert decode.calls == []


def test_reserve_tells_the_handler_the_peer_host(client: DecodeControlClient, decode: RecordingDecode) -> None:
    client.reserve("r", 3, 5.0)
    assert decode.calls == [("reserve", "r", 3, 5.0, "127.0.0.1")]


def test_oversized_ids_and_maps_are_refused_naming_the_limit(client: DecodeControlClient,
                                                             decode: RecordingDecode) -> None:
    with pytest.raises(InvalidArgumentError, match=f"request_id has {MAX_ID_CHARS + 1} characters"):
        client.reserve("x" * (MAX_ID_CHARS + 1), 1, 5.0)
    with pytest.raises(InvalidArgumentError, match=f"checksums has {MAX_CHECKSUMS + 1} entries"):
        client.transfer_ready("r", 0, 1, 1, {f"0/mla.{i}": "0:0" for i in range(MAX_CHECKSUMS + 1)})
    with pytest.raises(InvalidArgumentError, match=f"request_ids has {MAX_HEARTBEAT_IDS + 1} entries"):
        client.heartbeat([f"r{i}" for i in range(MAX_HEARTBEAT_IDS + 1)], "p")
    assert decode.calls == []


def test_peer_host_strips_the_port_of_every_address_family() -> None:
    assert peer_host("ipv4:10.0.0.7:41234") == "10.0.0.7"
    assert peer_host("ipv6:[::1]:5") == "::1"
    assert peer_host("unix:/tmp/sock") == "/tmp/sock"


@pytest.mark.parametrize("secret", ["", "short", " padded-secret-0123456789 ", "non-ascii-secret-\u00e9\u00e9\u00e9\u00e9"])
def test_an_unusable_secret_is_refused_without_echoing_it(secret: str) -> None:
    with pytest.raises(ValueError, match="control-plane secret") as e:
        check_secret(secret, "internal_secret")
    assert not secret.strip() or secret.strip() not in str(e.value)
    with pytest.raises(ValueError):
        SecretCheck(secret)
