"""Specification of the gRPC control plane (transfer/control.py): a real server on loopback, a real
client, a small in-test decode handler.

    client (prefill rank) --- Handshake / Reserve / TransferReady / Abort / Heartbeat ---> server
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")

from k3serve.transfer.backend import AgentInfo, RegionDesc  # noqa: E402
from k3serve.transfer.control import (  # noqa: E402
    ChecksumMismatchError,
    ControlPlaneError,
    DecodeControlClient,
    DecodeControlServer,
    ErrorCode,
    HandshakeInfo,
    IncompatiblePeerError,
    NoCapacityError,
    PeerRestartedError,
    PeerUnreachableError,
    Reservation,
    UnknownRequestError,
    agent_info_from_proto,
    agent_info_to_proto,
)

REPO = Path(__file__).resolve().parents[2]
COMPAT = "compat-aaaa"
SECRET = "test-deployment-secret-0123456789"
PREFILL_AGENT = AgentInfo(
    backend="local", endpoint="prefill-0", metadata=b"\x00\xffmeta",
    regions=(RegionDesc("mla.0", 0x7F00_0000_1000, 4096, "cpu"), RegionDesc("kda_recurrent.0", 2**63 + 8, 65536, "cuda:1")),
)
DECODE_AGENT = AgentInfo(backend="local", endpoint="decode-0", metadata=b"", regions=(RegionDesc("mla.0", 0x1000, 8192, "cpu"),))


class FakeDecode:
    """A decode rank in miniature: a block free list, a slot free list, leases, and checksum
    verification once every expected prefill rank reported."""

    def __init__(self, num_blocks: int = 64, num_slots: int = 4, block_size: int = 16, prefill_tp: int = 2) -> None:
        self.free_blocks = list(range(num_blocks))
        self.free_slots = list(range(num_slots))
        self.block_size = block_size
        self.prefill_tp = prefill_tp
        self.requests: dict[str, dict] = {}
        self.expected_checksums: dict[str, dict[str, str]] = {}  # what the decode side computes
        self.ready: dict[str, int] = {}  # request_id -> first_token_id once verified
        self.aborted: dict[str, str] = {}
        self.heartbeats: list[tuple[list[str], str]] = []
        self.lock = threading.Lock()
        self.fail_with: Exception | None = None
        self.delay_s = 0.0

    def _maybe_fail(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail_with is not None:
            raise self.fail_with

    def handshake(self, peer: AgentInfo, layout_json: str, tp_size: int, tp_rank: int,
                  request_id: str) -> HandshakeInfo:
        self._maybe_fail()
        self.peer = (peer, layout_json, tp_size, tp_rank)
        return HandshakeInfo(DECODE_AGENT, '{"decode": true}', 1, 0)

    def reserve(self, request_id: str, num_tokens: int, lease_seconds: float, peer: str) -> Reservation:
        self._maybe_fail()
        self.reserved_by = peer
        num_blocks = -(-num_tokens // self.block_size)
        with self.lock:
            if num_blocks > len(self.free_blocks) or not self.free_slots:
                raise NoCapacityError(f"no capacity: need {num_blocks} blocks, {len(self.free_blocks)} free, "
                                      f"{len(self.free_slots)} slots free")
            blocks = [self.free_blocks.pop() for _ in range(num_blocks)]
            slot = self.free_slots.pop()
            self.requests[request_id] = {"blocks": blocks, "slot": slot, "ranks": {}, "deadline": time.time() + lease_seconds}
        return Reservation(tuple(blocks), slot, self.requests[request_id]["deadline"])

    def _free(self, request_id: str) -> None:
        r = self.requests.pop(request_id)
        self.free_blocks += r["blocks"]
        self.free_slots.append(r["slot"])

    def transfer_ready(self, request_id: str, from_rank: int, first_token_id: int, num_tokens: int,
                       checksums: dict[str, str], attempt: int) -> None:
        self._maybe_fail()
        with self.lock:
            if request_id not in self.requests:
                raise UnknownRequestError(f"unknown request {request_id}")
            r = self.requests[request_id]
            r["ranks"][from_rank] = checksums
            if len(r["ranks"]) < self.prefill_tp:
                return
            reported = {name: digest for sums in r["ranks"].values() for name, digest in sums.items()}
            for name, digest in sorted(self.expected_checksums.get(request_id, {}).items()):
                if reported.get(name) != digest:  # missing counts as wrong: fail closed
                    self._free(request_id)
                    raise ChecksumMismatchError(f"{name}: got {reported.get(name)}, decode computed {digest}")
            self.ready[request_id] = first_token_id

    def abort(self, request_id: str, reason: str) -> None:
        self._maybe_fail()
        with self.lock:
            self.aborted[request_id] = reason
            if request_id in self.requests:
                self._free(request_id)

    def heartbeat(self, request_ids: list[str], sender: str) -> list[str]:
        self._maybe_fail()
        with self.lock:
            self.heartbeats.append((request_ids, sender))
            return [rid for rid in request_ids if rid not in self.requests]


@pytest.fixture
def decode() -> FakeDecode:
    return FakeDecode()


@pytest.fixture
def server(decode: FakeDecode):
    server = DecodeControlServer(decode, COMPAT, secret=SECRET).start()
    yield server
    server.stop(0)


@pytest.fixture
def client(server: DecodeControlServer):
    client = DecodeControlClient(server.address, COMPAT, timeout_s=2.0, secret=SECRET)
    yield client
    client.close()


def test_conversion_round_trips_agent_info_with_64_bit_addresses() -> None:
    assert agent_info_from_proto(agent_info_to_proto(PREFILL_AGENT)) == PREFILL_AGENT


def test_port_is_bound_by_the_kernel_and_published(decode: FakeDecode) -> None:
    server = DecodeControlServer(decode, COMPAT, secret=SECRET)
    with pytest.raises(RuntimeError, match="before start"):
        server.address
    server.start()
    try:
        assert server.port is not None and server.port > 0
        assert server.address == f"127.0.0.1:{server.port}"
        # An explicit port already in use fails loudly (no SO_REUSEPORT sharing).
        with pytest.raises(ControlPlaneError, match="cannot bind"):
            DecodeControlServer(decode, COMPAT, port=server.port, secret=SECRET).start()
    finally:
        server.stop(0)


def test_handshake_exchanges_agents_layouts_and_tp(client: DecodeControlClient, decode: FakeDecode,
                                                   server: DecodeControlServer) -> None:
    info = client.handshake(PREFILL_AGENT, '{"prefill": true}', tp_size=2, tp_rank=1)
    assert info == HandshakeInfo(DECODE_AGENT, '{"decode": true}', 1, 0)
    assert decode.peer == (PREFILL_AGENT, '{"prefill": true}', 2, 1)
    assert client.peer_instance_id == server.instance_id


def test_handshake_with_a_different_compat_hash_is_refused_revealing_nothing_of_the_decode(
        server: DecodeControlServer, decode: FakeDecode) -> None:
    with DecodeControlClient(server.address, "compat-bbbb", timeout_s=2.0, secret=SECRET) as other:
        with pytest.raises(IncompatiblePeerError) as e:
            other.handshake(PREFILL_AGENT, "{}", tp_size=1, tp_rank=0)
    assert "compat-bbbb" in str(e.value) and "compat-aaaa" not in str(e.value)
    assert server.instance_id not in str(e.value)
    assert e.value.code == ErrorCode.INCOMPATIBLE
    assert not hasattr(decode, "peer")  # the handler never saw the incompatible peer


def test_handshake_with_a_bad_tp_rank_is_refused(client: DecodeControlClient) -> None:
    with pytest.raises(ControlPlaneError, match="tp_rank 2 of tp_size 2"):
        client.handshake(PREFILL_AGENT, "{}", tp_size=2, tp_rank=2)


def test_reserve_ready_round_trip(client: DecodeControlClient, decode: FakeDecode) -> None:
    client.handshake(PREFILL_AGENT, "{}", tp_size=2, tp_rank=0)
    before = time.time()
    r = client.reserve("req-1", num_tokens=40, lease_seconds=30.0)
    assert len(r.block_ids) == 3 and len(set(r.block_ids)) == 3
    assert r.slot_id in range(4)
    assert before + 29 < r.lease_deadline_unix < time.time() + 31
    decode.expected_checksums["req-1"] = {"mla": "aa", "kda.0": "bb", "kda.1": "cc"}
    client.transfer_ready("req-1", from_rank=0, first_token_id=1234, num_tokens=40, checksums={"mla": "aa", "kda.0": "bb"})
    assert "req-1" not in decode.ready  # waits for every prefill rank
    client.transfer_ready("req-1", from_rank=1, first_token_id=1234, num_tokens=40, checksums={"kda.1": "cc"})
    assert decode.ready == {"req-1": 1234}


def test_checksum_mismatch_is_refused(client: DecodeControlClient, decode: FakeDecode) -> None:
    client.reserve("req-1", num_tokens=16, lease_seconds=30.0)
    decode.expected_checksums["req-1"] = {"kda.0": "good", "kda.1": "good"}
    client.transfer_ready("req-1", from_rank=0, first_token_id=7, num_tokens=16, checksums={"kda.0": "good"})
    with pytest.raises(ChecksumMismatchError, match="kda.1: got None"):  # a rank left one out
        client.transfer_ready("req-1", from_rank=1, first_token_id=7, num_tokens=16, checksums={})
    # a wrong digest from any rank
    client.reserve("req-2", num_tokens=16, lease_seconds=30.0)
    decode.expected_checksums["req-2"] = {"kda.1": "good"}
    client.transfer_ready("req-2", from_rank=0, first_token_id=7, num_tokens=16, checksums={})
    with pytest.raises(ChecksumMismatchError, match="kda.1: got bad, decode computed good"):
        client.transfer_ready("req-2", from_rank=1, first_token_id=7, num_tokens=16, checksums={"kda.1": "bad"})
    assert decode.ready == {} and decode.requests == {}


def test_no_capacity_is_a_normal_refusal(client: DecodeControlClient, decode: FakeDecode) -> None:
    for i in range(4):
        client.reserve(f"req-{i}", num_tokens=1, lease_seconds=30.0)
    with pytest.raises(NoCapacityError, match="no capacity") as e:
        client.reserve("req-4", num_tokens=1, lease_seconds=30.0)
    assert e.value.code == ErrorCode.NO_CAPACITY
    client.abort("req-0", "client went away")
    client.reserve("req-4", num_tokens=1, lease_seconds=30.0)  # the freed slot is reusable


def test_abort_and_heartbeat_round_trip(client: DecodeControlClient, decode: FakeDecode) -> None:
    client.handshake(PREFILL_AGENT, "{}", tp_size=2, tp_rank=0)
    client.reserve("req-1", num_tokens=16, lease_seconds=30.0)
    client.reserve("req-2", num_tokens=16, lease_seconds=30.0)
    client.abort("req-1", "prefill timeout")
    assert decode.aborted == {"req-1": "prefill timeout"}
    assert client.heartbeat(["req-1", "req-2", "req-9"], sender="prefill-0/rank0") == ["req-1", "req-9"]
    assert decode.heartbeats == [(["req-1", "req-2", "req-9"], "prefill-0/rank0")]
    assert client.heartbeat([], sender="prefill-0/rank0") == []
    with pytest.raises(UnknownRequestError, match="unknown request req-1"):
        client.transfer_ready("req-1", from_rank=0, first_token_id=1, num_tokens=16, checksums={})


def test_empty_request_id_is_refused(client: DecodeControlClient) -> None:
    with pytest.raises(ControlPlaneError, match="request_id is empty") as e:
        client.reserve("", num_tokens=1, lease_seconds=1.0)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.parametrize("rpc", ["handshake", "reserve", "transfer_ready", "abort", "heartbeat"])
def test_handler_exception_reaches_the_client_with_its_message(client: DecodeControlClient, decode: FakeDecode,
                                                               rpc: str) -> None:
    decode.fail_with = ValueError("slot pool poisoned at slot 3")
    calls = {
        "handshake": lambda: client.handshake(PREFILL_AGENT, "{}", 1, 0),
        "reserve": lambda: client.reserve("r", 1, 1.0),
        "transfer_ready": lambda: client.transfer_ready("r", 0, 1, 1, {}),
        "abort": lambda: client.abort("r", "x"),
        "heartbeat": lambda: client.heartbeat(["r"], "p"),
    }
    with pytest.raises(ControlPlaneError, match="ValueError: slot pool poisoned at slot 3") as e:
        calls[rpc]()
    assert e.value.code == ErrorCode.INTERNAL
    decode.fail_with = None  # the server survived its handler's bug
    assert client.heartbeat([], "p") == []


def test_slow_handler_fails_within_the_deadline(server: DecodeControlServer, decode: FakeDecode) -> None:
    decode.delay_s = 2.0
    with DecodeControlClient(server.address, COMPAT, timeout_s=0.3, secret=SECRET) as fast:
        start = time.monotonic()
        with pytest.raises(PeerUnreachableError, match="DEADLINE_EXCEEDED") as e:
            fast.reserve("req-1", 1, 1.0)
        assert time.monotonic() - start < 1.0
    assert e.value.status == grpc.StatusCode.DEADLINE_EXCEEDED


def test_restarted_server_is_detected(decode: FakeDecode) -> None:
    first = DecodeControlServer(decode, COMPAT, secret=SECRET).start()
    port = first.port
    client = DecodeControlClient(first.address, COMPAT, timeout_s=2.0, secret=SECRET)
    try:
        client.handshake(PREFILL_AGENT, "{}", 1, 0)
        client.reserve("req-1", 1, 30.0)
        first.stop(0)
        second = DecodeControlServer(FakeDecode(), COMPAT, port=port, secret=SECRET).start()
        try:
            deadline = time.monotonic() + 5
            while True:  # the channel reconnects within its (short) backoff
                try:
                    client.heartbeat(["req-1"], "p")
                except PeerUnreachableError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                    continue
                except PeerRestartedError as e:
                    assert first.instance_id in str(e) and second.instance_id in str(e)
                    break
                raise AssertionError("heartbeat to a restarted server did not raise PeerRestartedError")
            with pytest.raises(PeerRestartedError, match="handshake again"):
                client.reserve("req-2", 1, 30.0)  # refused before anything was reserved on the new instance
            client.handshake(PREFILL_AGENT, "{}", 1, 0)
            client.reserve("req-2", 1, 30.0)
        finally:
            second.stop(0)
    finally:
        client.close()


SERVER_SCRIPT = textwrap.dedent("""
    import sys, time
    from k3serve.transfer.control import DecodeControlServer, Reservation
    class Handler:
        def reserve(self, request_id, num_tokens, lease_seconds, peer):
            return Reservation((1, 2), 0, time.time() + lease_seconds)
        def heartbeat(self, request_ids, sender):
            return []
    server = DecodeControlServer(Handler(), sys.argv[1], secret=sys.argv[2]).start()
    print(server.port, flush=True)
    time.sleep(600)
""")


def test_killed_server_fails_the_call_within_its_deadline() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, COMPAT, SECRET], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        port = int(proc.stdout.readline())
        assert port > 0
        with DecodeControlClient(f"127.0.0.1:{port}", COMPAT, timeout_s=1.0, secret=SECRET) as client:
            assert client.reserve("req-1", 1, 5.0).block_ids == (1, 2)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            for rpc in (lambda: client.reserve("req-2", 1, 5.0), lambda: client.heartbeat(["req-1"], "p")):
                start = time.monotonic()
                with pytest.raises(PeerUnreachableError, match="127.0.0.1") as e:
                    rpc()
                assert time.monotonic() - start < 1.5, "the call outlived its deadline"
                assert e.value.status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_control_plane_overhead_per_request_is_small(client: DecodeControlClient, decode: FakeDecode) -> None:
    """Reserve + TransferReady per request (handshake excluded), 200 requests over loopback."""
    decode.prefill_tp = 1
    client.handshake(PREFILL_AGENT, "{}", 1, 0)
    for i in range(20):  # warm-up
        client.reserve(f"warm-{i}", 16, 30.0)
        client.abort(f"warm-{i}", "warm-up")
    times = []
    for i in range(200):
        start = time.perf_counter()
        client.reserve(f"req-{i}", 16, 30.0)
        client.transfer_ready(f"req-{i}", 0, 1, 16, {"mla": "00ff", "kda_recurrent": "11ee", "kda_conv": "22dd"})
        times.append(time.perf_counter() - start)
        decode.abort(f"req-{i}", "done")  # free locally, outside the timed section
    median_ms = 1000 * statistics.median(times)
    p99_ms = 1000 * sorted(times)[int(0.99 * len(times)) - 1]
    print(f"\ncontrol-plane overhead per request (Reserve + TransferReady): median {median_ms:.3f} ms, p99 {p99_ms:.3f} ms")
    assert median_ms < 5.0
