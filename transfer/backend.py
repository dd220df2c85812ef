"""The one interface every transfer backend implements: register memory, post one-sided writes, poll.

Backends: `local` (same process, for single-process tests), `mooncake` (Mooncake Transfer
Engine: TCP with P2PHANDSHAKE on CPU hosts, RDMA/NVLink on GPU hosts) and `nixl` (NIXL over UCX).
The engine never sees which one runs: the sender registers its cache tensors, learns the
receiver's regions from the control plane (gRPC handshake), and posts batches of
(local address, remote address, length) writes that complete asynchronously.

    prefill rank                                   decode rank
    register(cache tensors) -> RegionDesc ...      register(cache tensors) -> RegionDesc ...
    connect(peer AgentInfo)  <--- handshake --->   agent_info()
    handle = write(peer, [(src, dst, len), ...])
    poll(handle) -> PENDING ... DONE | FAILED
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferError(RuntimeError):
    """A backend could not start, register, connect or post; the message says what to fix."""


@dataclass(frozen=True)
class RegionDesc:
    """A registered memory region, as the peer needs to address it."""

    name: str  # e.g. "mla.3", "kda_recurrent.0", "kda_conv.0"
    addr: int  # base address in the owner's address space
    length: int  # bytes
    device: str  # "cpu" or "cuda:N"


@dataclass(frozen=True)
class AgentInfo:
    """What a peer needs to reach this agent: backend name, its address/metadata, its regions."""

    backend: str
    endpoint: str  # mooncake: "host:rpc_port"; nixl: agent name; local: agent id
    metadata: bytes  # opaque backend metadata (nixl agent metadata); b"" when unused
    regions: tuple[RegionDesc, ...]


@dataclass(frozen=True)
class WriteOp:
    src_addr: int  # local address (inside a region this agent registered)
    dst_addr: int  # remote address (inside a region the peer registered)
    length: int  # bytes


class TransferBackend(ABC):
    """One agent of one backend on one rank. Not thread-safe: one owner thread drives it."""

    name: str

    @abstractmethod
    def register(self, name: str, tensor: torch.Tensor) -> RegionDesc:
        """Register a contiguous tensor's memory for one-sided access; keep it alive until close()."""

    @abstractmethod
    def agent_info(self) -> AgentInfo:
        """This agent's endpoint, metadata and registered regions, for the peer's handshake."""

    @abstractmethod
    def connect(self, peer: AgentInfo) -> str:
        """Make `peer` reachable; returns the peer key used by write(). Idempotent."""

    @abstractmethod
    def write(self, peer: str, ops: list[WriteOp], notify: bytes | None = None) -> int:
        """Post a batch of one-sided writes into the peer's memory; returns a handle. Never blocks
        on completion. `notify` (if the backend supports it) reaches the peer when all ops land."""

    @abstractmethod
    def poll(self, handle: int) -> TransferStatus:
        """PENDING until every op of the batch has landed (DONE) or any failed (FAILED)."""

    @abstractmethod
    def release(self, handle: int) -> None:
        """Forget a finished (or abandoned) handle and free its backend resources."""

    @abstractmethod
    def close(self) -> None:
        """Deregister everything and stop the agent. Safe to call twice."""
