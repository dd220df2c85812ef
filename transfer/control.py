"""The gRPC control plane between a prefill rank (client) and a decode rank (server); schema
transfer/proto/transfer.proto. Only small control messages travel here; MLA KV and KDA state move over the
transfer backend.

    prefill rank (DecodeControlClient)             decode rank (DecodeControlServer -> handler)
    handshake(agent, layout_json, tp, id)  --->    HandshakeInfo, refused unless compat hashes match (rank 0:
                                                   and `id` holds a live reservation)
    reserve(request_id, num_tokens, lease) --->    Reservation(block_ids, slot_id, deadline, attempt)
    transfer_ready(request_id, rank, ...)  --->    checksums verified once all ranks reported (same attempt)
    heartbeat(request_ids, sender)         --->    leases extended; unknown ids come back
    abort(request_id, reason)              --->    reservation freed

Every decode rank answers `handshake`; only decode rank 0 answers the rest. Every call carries the deployment's
secret (transfer/auth.py), checked before anything else: a call without it is refused UNAUTHENTICATED and learns
nothing. Every field is checked against its bound here (`_check_*`) before the handler sees it. Every `ok = false`
answer and every failed or timed-out RPC raises a `ControlPlaneError` subclass on the client; every call carries
a deadline. Who answers what and why: docs/design/control_plane.md.
"""

from __future__ import annotations

import enum
import logging
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

import grpc

from k3serve.engine.host_ip import check_host_ip, uri_host
from k3serve.transfer.auth import METADATA_KEY, ControlTLS, SecretCheck, check_secret
from k3serve.transfer.backend import AgentInfo, RegionDesc
from k3serve.transfer.proto import transfer_pb2 as pb
from k3serve.transfer.proto import transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

__all__ = [
    "ErrorCode", "ControlPlaneError", "IncompatiblePeerError", "InvalidArgumentError", "NoCapacityError",
    "UnknownRequestError", "ChecksumMismatchError", "PeerRestartedError", "PeerUnreachableError",
    "UnauthenticatedPeerError", "peer_host",
    "HandshakeInfo", "Reservation", "DecodeControlHandler", "DecodeControlServer", "DecodeControlClient",
    "region_to_proto", "region_from_proto", "agent_info_to_proto", "agent_info_from_proto",
]


class ErrorCode(enum.IntEnum):
    """Why an `ok = false` answer was given (mirrors `k3serve.transfer.v1.ErrorCode`)."""

    UNSPECIFIED = pb.ERROR_CODE_UNSPECIFIED
    INTERNAL = pb.ERROR_CODE_INTERNAL
    INCOMPATIBLE = pb.ERROR_CODE_INCOMPATIBLE
    INVALID_ARGUMENT = pb.ERROR_CODE_INVALID_ARGUMENT
    NO_CAPACITY = pb.ERROR_CODE_NO_CAPACITY
    UNKNOWN_REQUEST = pb.ERROR_CODE_UNKNOWN_REQUEST
    CHECKSUM_MISMATCH = pb.ERROR_CODE_CHECKSUM_MISMATCH
    PEER_RESTARTED = pb.ERROR_CODE_PEER_RESTARTED
    UNREACHABLE = pb.ERROR_CODE_UNREACHABLE


# ----------------------------------------------------------------------------------------------
# Errors. A handler raises the same classes to answer ok = false with that code; the client
# raises the class matching the code it received.


class ControlPlaneError(RuntimeError):
    """A control-plane call failed or was refused; the message says which peer, which RPC, why."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class IncompatiblePeerError(ControlPlaneError):
    code = ErrorCode.INCOMPATIBLE


class UnauthenticatedPeerError(IncompatiblePeerError):
    """The server refused the call before reading it: this client does not hold the deployment's secret."""


class InvalidArgumentError(ControlPlaneError):
    code = ErrorCode.INVALID_ARGUMENT


class NoCapacityError(ControlPlaneError):
    """503-like: the decode rank has no free blocks or slot right now; try another replica."""

    code = ErrorCode.NO_CAPACITY


class UnknownRequestError(ControlPlaneError):
    """The receiver no longer knows the request (lease expired, aborted, never reserved)."""

    code = ErrorCode.UNKNOWN_REQUEST


class ChecksumMismatchError(ControlPlaneError):
    code = ErrorCode.CHECKSUM_MISMATCH


class PeerRestartedError(ControlPlaneError):
    """The server is a new instance: every request held with it is gone, its regions moved."""

    code = ErrorCode.PEER_RESTARTED


class PeerUnreachableError(ControlPlaneError):
    """The RPC itself failed (peer down, deadline exceeded); `status` is the gRPC status code."""

    code = ErrorCode.UNREACHABLE

    def __init__(self, message: str, *, status: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.status = status


_ERROR_BY_CODE: dict[int, type[ControlPlaneError]] = {
    cls.code: cls
    for cls in (IncompatiblePeerError, InvalidArgumentError, NoCapacityError, UnknownRequestError,
                ChecksumMismatchError, PeerRestartedError, PeerUnreachableError)
}


# ----------------------------------------------------------------------------------------------
# What the handler returns and the client hands back.


class HandshakeInfo(NamedTuple):
    """One side of a handshake, as the other side sees it."""

    agent: AgentInfo  # transfer agent: backend, endpoint, metadata, registered regions
    layout_json: str  # CacheLayout as JSON (parsed by the caller, opaque here)
    tp_size: int
    tp_rank: int


@dataclass(frozen=True)
class Reservation:
    """MLA blocks and one KDA slot held on a decode rank for one request, until the lease ends."""

    block_ids: tuple[int, ...]  # [num_blocks] MLA block ids, in sequence order
    slot_id: int  # KDA state slot (recurrent + conv window)
    lease_deadline_unix: float  # seconds since the epoch, decode host clock
    attempt: int = 0  # the handoff attempt this reservation is (from 1, new on every reserve); 0: none


class DecodeControlHandler(Protocol):
    """What the decode worker implements. Called from the server's thread pool, possibly
    concurrently: guard shared state. Raise a `ControlPlaneError` subclass to answer ok = false
    with its code (e.g. `NoCapacityError("no capacity: 0 free blocks")`); any other exception
    is answered ok = false, code INTERNAL, with its message. The compat hash is checked before
    `handshake` is called."""

    def handshake(self, peer: AgentInfo, layout_json: str, tp_size: int, tp_rank: int,
                  request_id: str) -> HandshakeInfo:
        """`request_id`: the reservation the peer is about to write ('' when it names none); a handler that
        knows reservations answers only a live one's."""
        ...

    def reserve(self, request_id: str, num_tokens: int, lease_seconds: float, peer: str) -> Reservation:
        """`num_tokens` >= 1 and `lease_seconds` finite and >= 0 (0: the handler's default) are checked already;
        `peer` is the caller's host (`peer_host`), for per-peer limits."""
        ...

    def transfer_ready(self, request_id: str, from_rank: int, first_token_id: int, num_tokens: int,
                       checksums: dict[str, str], attempt: int) -> None:
        """Refuse (UnknownRequestError) unless `attempt` is the request's live reservation's."""
        ...

    def abort(self, request_id: str, reason: str) -> None: ...

    def heartbeat(self, request_ids: list[str], sender: str) -> list[str]:
        """Extend the leases of the known ids; return the ids this rank no longer knows."""
        ...


# ----------------------------------------------------------------------------------------------
# Conversions between the transfer/backend.py dataclasses and the proto messages.


def region_to_proto(region: RegionDesc) -> pb.Region:
    return pb.Region(name=region.name, addr=region.addr, length=region.length, device=region.device)


def region_from_proto(msg: pb.Region) -> RegionDesc:
    return RegionDesc(name=msg.name, addr=msg.addr, length=msg.length, device=msg.device)


def agent_info_to_proto(info: AgentInfo) -> pb.AgentInfo:
    return pb.AgentInfo(backend=info.backend, endpoint=info.endpoint, metadata=bytes(info.metadata),
                        regions=[region_to_proto(r) for r in info.regions])


def agent_info_from_proto(msg: pb.AgentInfo) -> AgentInfo:
    return AgentInfo(backend=msg.backend, endpoint=msg.endpoint, metadata=bytes(msg.metadata),
                     regions=tuple(region_from_proto(r) for r in msg.regions))


# ----------------------------------------------------------------------------------------------
# Server.

_Response = TypeVar("_Response")


# Bounds of what a request may carry, checked before its handler runs (a flood of huge maps or ids costs the
# server nothing but the refusal). gRPC's own 4 MiB message limit stays below them all.
MAX_ID_CHARS = 256  # request_id, sender
MAX_REASON_CHARS = 1024
MAX_CHECKSUMS = 4096  # TransferReady entries: decode ranks x regions
MAX_CHECKSUM_KEY_CHARS, MAX_CHECKSUM_CHARS = 256, 64
MAX_HEARTBEAT_IDS = 4096
MAX_LAYOUT_CHARS = 1 << 20
MAX_REGIONS = 4096
MAX_METADATA_BYTES = 1 << 16


def peer_host(context_peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:10.0.0.7:41234" -> "10.0.0.7", "ipv6:[::1]:5" -> "::1")."""
    _, _, address = context_peer.partition(":")
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]") or context_peer


def _check_text(value: str, field_name: str, max_chars: int, *, required: bool = True) -> None:
    if required and not value:
        raise InvalidArgumentError(f"{field_name} is empty")
    if len(value) > max_chars:
        raise InvalidArgumentError(f"{field_name} has {len(value)} characters, more than the limit {max_chars}")


def _check_count(n: int, field_name: str, limit: int) -> None:
    if n > limit:
        raise InvalidArgumentError(f"{field_name} has {n} entries, more than the limit {limit}")


def _check_agent(agent: pb.AgentInfo) -> None:
    _check_count(len(agent.regions), "agent.regions", MAX_REGIONS)
    _check_text(agent.endpoint, "agent.endpoint", MAX_ID_CHARS, required=False)
    if len(agent.metadata) > MAX_METADATA_BYTES:
        raise InvalidArgumentError(f"agent.metadata has {len(agent.metadata)} bytes, more than the limit "
                                   f"{MAX_METADATA_BYTES}")


def _check_reserve(request: pb.ReserveRequest) -> None:
    if request.num_tokens < 1:
        raise InvalidArgumentError(f"num_tokens must be >= 1, got {request.num_tokens}")
    lease = request.lease_seconds
    if not math.isfinite(lease) or lease < 0:
        raise InvalidArgumentError(f"lease_seconds must be finite and >= 0 (0: the decode's default), got {lease!r}")


def _check_checksums(checksums: Mapping[str, str]) -> None:
    _check_count(len(checksums), "checksums", MAX_CHECKSUMS)
    for key, value in checksums.items():
        _check_text(key, "a checksums key", MAX_CHECKSUM_KEY_CHARS)
        _check_text(value, f"checksums[{key!r}]", MAX_CHECKSUM_CHARS)


class _Servicer(pb_grpc.DecodeControlServicer):
    """Validates, calls the handler, and turns every exception into an ok = false answer. Only authenticated
    calls get here (`SecretCheck` runs first)."""

    def __init__(self, handler: DecodeControlHandler, compat_hash: str, instance_id: str) -> None:
        self._handler = handler
        self._compat_hash = compat_hash
        self._instance_id = instance_id

    def _guarded(self, rpc: str, response_cls: Callable[..., _Response], fn: Callable[[], _Response]) -> _Response:
        try:
            return fn()
        except ControlPlaneError as e:
            return response_cls(ok=False, error=str(e), code=int(e.code))
        except Exception as e:  # the handler's bug must reach the caller, never crash the server
            logger.exception("DecodeControl.%s handler raised", rpc)
            return response_cls(ok=False, error=f"{type(e).__name__}: {e}", code=int(ErrorCode.INTERNAL))

    @staticmethod
    def _require_request_id(request_id: str) -> None:
        _check_text(request_id, "request_id", MAX_ID_CHARS)

    def Handshake(self, request: pb.HandshakeRequest, context: grpc.ServicerContext) -> pb.HandshakeResponse:
        """A refusal carries the reason only: the compat hash and instance id go with an accepted handshake."""
        def run() -> pb.HandshakeResponse:
            if request.compat_hash != self._compat_hash:
                raise IncompatiblePeerError(
                    f"incompatible peer: prefill compat_hash {request.compat_hash!r:.80} is not this decode's (model "
                    "config, cache dtype, block size or layout version differ)")
            if request.tp_size < 1 or request.tp_rank >= request.tp_size:
                raise InvalidArgumentError(f"bad prefill TP: tp_rank {request.tp_rank} of tp_size {request.tp_size}")
            _check_agent(request.agent)
            _check_text(request.layout_json, "layout_json", MAX_LAYOUT_CHARS)
            _check_text(request.request_id, "request_id", MAX_ID_CHARS, required=False)
            info = self._handler.handshake(agent_info_from_proto(request.agent), request.layout_json,
                                           request.tp_size, request.tp_rank, request.request_id)
            return pb.HandshakeResponse(ok=True, agent=agent_info_to_proto(info.agent), layout_json=info.layout_json,
                                        tp_size=info.tp_size, tp_rank=info.tp_rank, compat_hash=self._compat_hash,
                                        instance_id=self._instance_id)

        return self._guarded("Handshake", pb.HandshakeResponse, run)

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        def run() -> pb.ReserveResponse:
            self._require_request_id(request.request_id)
            _check_reserve(request)
            if request.instance_id and request.instance_id != self._instance_id:
                raise PeerRestartedError(f"decode rank restarted: handshake was with instance {request.instance_id}, "
                                         f"this is {self._instance_id}; handshake again")
            r = self._handler.reserve(request.request_id, request.num_tokens, request.lease_seconds,
                                      peer_host(context.peer()))
            return pb.ReserveResponse(ok=True, block_ids=r.block_ids, slot_id=r.slot_id,
                                      lease_deadline_unix=r.lease_deadline_unix, attempt=r.attempt)

        return self._guarded("Reserve", pb.ReserveResponse, run)

    def TransferReady(self, request: pb.TransferReadyRequest, context: grpc.ServicerContext) -> pb.Ack:
        def run() -> pb.Ack:
            self._require_request_id(request.request_id)
            _check_checksums(request.checksums)
            self._handler.transfer_ready(request.request_id, request.from_rank, request.first_token_id,
                                         request.num_tokens, dict(request.checksums), request.attempt)
            return pb.Ack(ok=True)

        return self._guarded("TransferReady", pb.Ack, run)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.Ack:
        def run() -> pb.Ack:
            self._require_request_id(request.request_id)
            _check_text(request.reason, "reason", MAX_REASON_CHARS, required=False)
            self._handler.abort(request.request_id, request.reason)
            return pb.Ack(ok=True)

        return self._guarded("Abort", pb.Ack, run)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        def run() -> pb.HeartbeatResponse:
            _check_count(len(request.request_ids), "request_ids", MAX_HEARTBEAT_IDS)
            _check_text(request.sender, "sender", MAX_ID_CHARS, required=False)
            for request_id in request.request_ids:
                self._require_request_id(request_id)
            unknown = self._handler.heartbeat(list(request.request_ids), request.sender)
            return pb.HeartbeatResponse(ok=True, unknown_request_ids=unknown)

        response = self._guarded("Heartbeat", pb.HeartbeatResponse, run)
        response.instance_id = self._instance_id
        return response


class DecodeControlServer:
    """Serves `DecodeControl` for one decode rank. `start()` binds (port 0 by default: the kernel
    picks a free port) and publishes the bound port in `.port` / `.address`; nothing guesses.

    `host` is both the address bound and the one published: the node's address that prefill ranks
    dial (cluster/node_address.py), on that interface only; never 0.0.0.0, which no peer could dial.
    `secret`: the deployment's (transfer/auth.py); every call without it is refused before the handler.
    `tls`: serve over mutual TLS only (clients must present a certificate of its CA); None: plain TCP."""

    def __init__(self, handler: DecodeControlHandler, compat_hash: str, host: str = "127.0.0.1",
                 port: int = 0, max_workers: int = 8, *, secret: str, tls: ControlTLS | None = None) -> None:
        if not compat_hash:
            raise ValueError("compat_hash is empty: pass the hash of model config + cache dtype + block size + layout")
        self._secret_check = SecretCheck(secret)
        self._tls = tls
        self.host = check_host_ip(host.strip("[]"), "DecodeControlServer host")
        self.port: int | None = None  # set by start()
        self.instance_id = uuid.uuid4().hex  # new per server: tells clients the regions moved
        self._requested_port = port
        self._servicer = _Servicer(handler, compat_hash, self.instance_id)
        self._max_workers = max_workers
        self._server: grpc.Server | None = None

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("DecodeControlServer.address before start()")
        return f"{uri_host(self.host)}:{self.port}"

    def start(self) -> DecodeControlServer:
        if self._server is not None:
            raise RuntimeError("DecodeControlServer.start() called twice")
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="k3-decode-control"),
            # No SO_REUSEPORT: a second server on an explicit port must fail, not share it silently.
            options=[("grpc.so_reuseport", 0)],
            interceptors=[self._secret_check],
        )
        pb_grpc.add_DecodeControlServicer_to_server(self._servicer, server)
        target = f"{uri_host(self.host)}:{self._requested_port}"
        try:
            port = (server.add_insecure_port(target) if self._tls is None
                    else server.add_secure_port(target, self._tls.server_credentials()))
        except RuntimeError as e:
            raise ControlPlaneError(f"DecodeControlServer cannot bind {target}: {e}") from None
        if port == 0:
            raise ControlPlaneError(f"DecodeControlServer cannot bind {target}")
        server.start()
        self._server, self.port = server, port
        logger.info("DecodeControl serving on %s (instance %s)", self.address, self.instance_id)
        return self

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls; wait up to `grace` seconds for calls in flight. Safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace).wait()

    def __enter__(self) -> DecodeControlServer:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop(0)


# ----------------------------------------------------------------------------------------------
# Client.

_CHANNEL_OPTIONS = [
    # Reconnect quickly after a peer restart instead of gRPC's default 1 s .. 120 s backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class DecodeControlClient:
    """Typed calls to one decode rank's `DecodeControl`, each with a `timeout_s` deadline.
    Raises a `ControlPlaneError` subclass on refusal (ok = false) or RPC failure; `UnauthenticatedPeerError`
    when the server does not take `secret` (the deployment's, transfer/auth.py). `tls`: call over mutual TLS (the
    server's `tls` must be set too); None: plain TCP. Thread-safe."""

    def __init__(self, address: str, compat_hash: str, timeout_s: float = 2.0, *, secret: str,
                 tls: ControlTLS | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._metadata = ((METADATA_KEY, check_secret(secret, "DecodeControlClient")),)
        self.address = address
        self.compat_hash = compat_hash
        self.timeout_s = timeout_s
        self.peer_instance_id = ""  # the server instance of the last successful handshake
        self._channel = (grpc.insecure_channel(address, options=_CHANNEL_OPTIONS) if tls is None
                         else grpc.secure_channel(address, tls.channel_credentials(), options=_CHANNEL_OPTIONS))
        self._stub = pb_grpc.DecodeControlStub(self._channel)

    def _call(self, rpc: str, request: object, what: str) -> object:
        try:
            response = getattr(self._stub, rpc)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            status = e.code() if isinstance(e, grpc.Call) else None
            details = e.details() if isinstance(e, grpc.Call) else str(e)
            if status is grpc.StatusCode.UNAUTHENTICATED:
                raise UnauthenticatedPeerError(f"DecodeControl.{rpc}({what}) refused by {self.address}: {details} "
                                               "(is this worker part of that deployment?)") from None
            name = status.name if status is not None else "RPC error"
            raise PeerUnreachableError(f"DecodeControl.{rpc}({what}) to {self.address} failed "
                                       f"(deadline {self.timeout_s:g} s): {name}: {details}", status=status) from None
        if not response.ok:
            message = f"DecodeControl.{rpc}({what}) refused by {self.address}: {response.error}"
            cls = _ERROR_BY_CODE.get(response.code)
            raise cls(message) if cls is not None else ControlPlaneError(message)
        return response

    def handshake(self, agent: AgentInfo, layout_json: str, tp_size: int, tp_rank: int,
                  request_id: str = "") -> HandshakeInfo:
        """Exchange agents and layouts; returns the decode rank's side. `request_id`: the reservation this
        rank is about to write (decode rank 0 refuses a handshake naming no live one)."""
        request = pb.HandshakeRequest(agent=agent_info_to_proto(agent), layout_json=layout_json, tp_size=tp_size,
                                      tp_rank=tp_rank, compat_hash=self.compat_hash, request_id=request_id)
        response = self._call("Handshake", request, f"tp_rank={tp_rank}")
        if response.compat_hash != self.compat_hash:  # a server that skipped its check must not pass
            raise IncompatiblePeerError(
                f"DecodeControl.Handshake to {self.address}: decode compat_hash {response.compat_hash!r} != "
                f"prefill compat_hash {self.compat_hash!r}")
        self.peer_instance_id = response.instance_id
        return HandshakeInfo(agent_info_from_proto(response.agent), response.layout_json,
                             response.tp_size, response.tp_rank)

    def reserve(self, request_id: str, num_tokens: int, lease_seconds: float) -> Reservation:
        """Reserve MLA blocks and one KDA slot. `NoCapacityError` means: try another replica."""
        request = pb.ReserveRequest(request_id=request_id, num_tokens=num_tokens, lease_seconds=lease_seconds,
                                    instance_id=self.peer_instance_id)
        response = self._call("Reserve", request, request_id)
        return Reservation(tuple(response.block_ids), response.slot_id, response.lease_deadline_unix,
                           response.attempt)

    def transfer_ready(self, request_id: str, from_rank: int, first_token_id: int, num_tokens: int,
                       checksums: Mapping[str, str], attempt: int = 0) -> None:
        """Report that every write of `from_rank` into reservation `attempt` of this request polled DONE."""
        request = pb.TransferReadyRequest(request_id=request_id, from_rank=from_rank, first_token_id=first_token_id,
                                          num_tokens=num_tokens, checksums=dict(checksums), attempt=attempt)
        self._call("TransferReady", request, f"{request_id}, rank {from_rank}")

    def abort(self, request_id: str, reason: str) -> None:
        self._call("Abort", pb.AbortRequest(request_id=request_id, reason=reason), request_id)

    def heartbeat(self, request_ids: Sequence[str], sender: str) -> list[str]:
        """Extend the leases; returns the ids the decode rank no longer knows (release their pins).
        Raises `PeerRestartedError` when the decode rank restarted since the handshake: then every
        request held with it is gone."""
        response = self._call("Heartbeat", pb.HeartbeatRequest(request_ids=list(request_ids), sender=sender),
                              f"{len(request_ids)} requests")
        if self.peer_instance_id and response.instance_id != self.peer_instance_id:
            raise PeerRestartedError(f"DecodeControl.Heartbeat: {self.address} restarted (instance "
                                     f"{self.peer_instance_id} -> {response.instance_id}); every request held "
                                     "with it is gone; handshake again")
        return list(response.unknown_request_ids)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DecodeControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
