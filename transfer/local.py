"""`LocalBackend`: the transfer interface inside one process, for tests and colocated runs.

Agents find each other in a process-wide registry by endpoint (the agent id). A write is checked
in full when it is posted (every op must lie inside one region this agent registered and one
region the peer registered, or TransferError and nothing moves) and lands later, when a poll
completes it, so tests see the same PENDING -> DONE | FAILED life as with a real NIC:

    post write(peer, ops)        poll #1 .. #N-1        poll #N (N = polls_to_complete)
    validate every op            PENDING                copy every op (ctypes.memmove on CPU,
    nothing copied yet                                  byte-view copy_ on CUDA), notify the
                                                        peer, DONE (or FAILED: fault / peer gone)

`fault` is the failure-injection hook: called with (peer endpoint, ops) when a batch completes;
returning a `Fault` fails the batch after landing its first `ops_landed` ops (a partial write,
the ATOM#2154 case that must never be reported as success).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3serve.transfer.backend import AgentInfo, RegionDesc, TransferBackend, TransferError, TransferStatus, WriteOp

_registry_lock = threading.Lock()
_registry: dict[str, "LocalBackend"] = {}  # endpoint -> live agent
_agent_ids = itertools.count()


@dataclass(frozen=True)
class Fault:
    """An injected failure: the batch FAILS after landing its first `ops_landed` ops."""

    reason: str
    ops_landed: int = 0


@dataclass
class _Region:
    desc: RegionDesc
    tensor: torch.Tensor  # kept alive until close()


@dataclass
class _Batch:
    peer: str
    ops: list[tuple[_Region, int, _Region, int, int]]  # (src region, src offset, dst region, dst offset, length)
    raw_ops: list[WriteOp]
    notify: bytes | None
    polls_left: int
    status: TransferStatus = TransferStatus.PENDING
    error: str = ""


class LocalBackend(TransferBackend):
    """One agent. `polls_to_complete`: how many polls a batch takes to land (1 = the first poll)."""

    name = "local"

    def __init__(
        self,
        endpoint: str = "",
        polls_to_complete: int = 1,
        fault: Callable[[str, list[WriteOp]], Fault | None] | None = None,
    ) -> None:
        if polls_to_complete < 1:
            raise ValueError(f"polls_to_complete must be >= 1, got {polls_to_complete}")
        self.endpoint = endpoint or f"local-{next(_agent_ids)}"
        self.polls_to_complete = polls_to_complete
        self.fault = fault
        self._regions: dict[str, _Region] = {}
        self._peers: set[str] = set()
        self._batches: dict[int, _Batch] = {}
        self._handles = itertools.count(1)
        self._notifications: list[tuple[str, bytes]] = []  # (sender endpoint, payload)
        self._closed = False
        with _registry_lock:
            if self.endpoint in _registry:
                raise TransferError(f"local agent {self.endpoint!r} already exists in this process")
            _registry[self.endpoint] = self

    # -- TransferBackend --------------------------------------------------------------------------
    def register(self, name: str, tensor: torch.Tensor) -> RegionDesc:
        self._check_open()
        if not tensor.is_contiguous():
            raise TransferError(f"region {name!r}: tensor must be contiguous")
        if name in self._regions:
            raise TransferError(f"region {name!r} is already registered on {self.endpoint}")
        desc = RegionDesc(name, tensor.data_ptr(), tensor.numel() * tensor.element_size(), str(tensor.device))
        self._regions[name] = _Region(desc, tensor)
        return desc

    def agent_info(self) -> AgentInfo:
        return AgentInfo("local", self.endpoint, b"", tuple(r.desc for r in self._regions.values()))

    def connect(self, peer: AgentInfo) -> str:
        self._check_open()
        if peer.backend != "local":
            raise TransferError(f"local backend cannot reach a {peer.backend!r} agent")
        agent = _lookup(peer.endpoint)
        if agent is None:
            raise TransferError(f"no local agent {peer.endpoint!r} in this process (closed or never started)")
        live = {r.desc for r in agent._regions.values()}
        stale = [r.name for r in peer.regions if r not in live]
        if stale:
            raise TransferError(f"peer {peer.endpoint!r} no longer has regions {stale} as advertised")
        self._peers.add(peer.endpoint)
        return peer.endpoint

    def write(self, peer: str, ops: list[WriteOp], notify: bytes | None = None) -> int:
        self._check_open()
        if peer not in self._peers:
            raise TransferError(f"peer {peer!r} is not connected; call connect() first")
        agent = _lookup(peer)
        if agent is None:
            raise TransferError(f"peer {peer!r} is gone")
        resolved = []
        for op in ops:
            if op.length <= 0:
                raise TransferError(f"write op with length {op.length}: {op}")
            src, src_off = _find(self._regions, op.src_addr, op.length, f"source of {op} on {self.endpoint}")
            dst, dst_off = _find(agent._regions, op.dst_addr, op.length, f"destination of {op} on {peer}")
            resolved.append((src, src_off, dst, dst_off, op.length))
        handle = next(self._handles)
        self._batches[handle] = _Batch(peer, resolved, list(ops), notify, self.polls_to_complete)
        return handle

    def poll(self, handle: int) -> TransferStatus:
        batch = self._batches.get(handle)
        if batch is None:
            raise TransferError(f"unknown transfer handle {handle}")
        if batch.status is TransferStatus.PENDING:
            batch.polls_left -= 1
            if batch.polls_left <= 0:
                self._complete(batch)
        return batch.status

    def release(self, handle: int) -> None:
        self._batches.pop(handle, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _registry_lock:
            if _registry.get(self.endpoint) is self:
                del _registry[self.endpoint]
        self._regions.clear()
        self._batches.clear()
        self._peers.clear()

    # -- local extras -----------------------------------------------------------------------------
    def get_notifications(self) -> list[tuple[str, bytes]]:
        """(sender endpoint, payload) of every notify that landed here since the last call."""
        notes, self._notifications = self._notifications, []
        return notes

    def error(self, handle: int) -> str:
        """Why a FAILED batch failed ('' otherwise)."""
        return self._batches[handle].error

    # -- internals --------------------------------------------------------------------------------
    def _complete(self, batch: _Batch) -> None:
        peer = _lookup(batch.peer)
        if peer is None:
            batch.status, batch.error = TransferStatus.FAILED, f"peer {batch.peer!r} went away"
            return
        fault = self.fault(batch.peer, batch.raw_ops) if self.fault else None
        landing = batch.ops if fault is None else batch.ops[: fault.ops_landed]
        for src, src_off, dst, dst_off, length in landing:
            _copy(src, src_off, dst, dst_off, length)
        if fault is not None:
            batch.status, batch.error = TransferStatus.FAILED, fault.reason
            return
        if batch.notify is not None:
            peer._notifications.append((self.endpoint, batch.notify))
        batch.status = TransferStatus.DONE

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"local agent {self.endpoint!r} is closed")


def live_agents() -> list[str]:
    """Endpoints of the local agents not yet closed (tests assert this is empty afterwards)."""
    with _registry_lock:
        return sorted(_registry)


def _lookup(endpoint: str) -> LocalBackend | None:
    with _registry_lock:
        return _registry.get(endpoint)


def _find(regions: dict[str, _Region], addr: int, length: int, what: str) -> tuple[_Region, int]:
    """The region holding [addr, addr + length) entirely, and the offset of addr in it."""
    for region in regions.values():
        base, size = region.desc.addr, region.desc.length
        if base <= addr and addr + length <= base + size:
            return region, addr - base
    raise TransferError(f"{what} lies outside every registered region")


def _copy(src: _Region, src_off: int, dst: _Region, dst_off: int, length: int) -> None:
    if src.tensor.device.type == "cpu" and dst.tensor.device.type == "cpu":
        ctypes.memmove(dst.desc.addr + dst_off, src.desc.addr + src_off, length)
        return
    src_bytes = src.tensor.view(-1).view(torch.uint8)[src_off : src_off + length]
    dst.tensor.view(-1).view(torch.uint8)[dst_off : dst_off + length].copy_(src_bytes)
