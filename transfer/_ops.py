"""Helpers shared by the mooncake and nixl backends: region lookup, op validation and coalescing,
page pre-faulting, per-handle deadlines and the table of open handles. Private to `k3serve.transfer`."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from .backend import RegionDesc, TransferError, WriteOp

PAGE = 4096
T = TypeVar("T")


class RegionIndex:
    """Registered regions sorted by address: which region holds [addr, addr + length)?"""

    def __init__(self, regions: tuple[RegionDesc, ...] | list[RegionDesc] = ()) -> None:
        self._regions: list[RegionDesc] = []
        self._starts: list[int] = []
        for r in regions:
            self.add(r)

    def add(self, region: RegionDesc) -> None:
        if region.length <= 0:
            raise TransferError(f"region {region.name!r} is empty")
        i = bisect.bisect_right(self._starts, region.addr)
        prev = self._regions[i - 1] if i > 0 else None
        nxt = self._regions[i] if i < len(self._regions) else None
        if (prev is not None and prev.addr + prev.length > region.addr) or (
            nxt is not None and region.addr + region.length > nxt.addr
        ):
            raise TransferError(f"region {region.name!r} overlaps a region registered before")
        self._regions.insert(i, region)
        self._starts.insert(i, region.addr)

    def remove(self, addr: int) -> None:
        i = bisect.bisect_left(self._starts, addr)
        if i < len(self._starts) and self._starts[i] == addr:
            del self._starts[i], self._regions[i]

    def find(self, addr: int, length: int) -> RegionDesc | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        r = self._regions[i]
        return r if addr + length <= r.addr + r.length else None

    def __iter__(self):
        return iter(self._regions)

    def __len__(self) -> int:
        return len(self._regions)


def check_ops(
    ops: list[WriteOp], local: RegionIndex, remote: RegionIndex, peer: str
) -> list[tuple[WriteOp, RegionDesc, RegionDesc]]:
    """Each op with its local (source) and remote (target) region; TransferError if any op falls
    outside the registered regions (a bad address would otherwise fail deep in the engine, or not
    at all and corrupt memory)."""
    if not ops:
        raise TransferError("write() needs at least one WriteOp")
    out = []
    for op in ops:
        if op.length <= 0:
            raise TransferError(f"{op}: length must be positive")
        src = local.find(op.src_addr, op.length)
        if src is None:
            raise TransferError(f"{op}: source range is not inside a region registered on this agent")
        dst = remote.find(op.dst_addr, op.length)
        if dst is None:
            raise TransferError(f"{op}: target range is not inside a region that peer {peer!r} registered")
        out.append((op, src, dst))
    return out


def coalesce(ops: list[WriteOp]) -> list[WriteOp]:
    """Merge runs of ops that are contiguous on both sides (block-by-block KV copies of adjacent
    blocks usually are): fewer, larger requests. Keeps the order of the first op of each run."""
    out: list[WriteOp] = []
    for op in ops:
        if out:
            last = out[-1]
            if last.src_addr + last.length == op.src_addr and last.dst_addr + last.length == op.dst_addr:
                out[-1] = WriteOp(last.src_addr, last.dst_addr, last.length + op.length)
                continue
        out.append(op)
    return out


def prefault(tensor: torch.Tensor) -> None:
    """Write-fault every page of a CPU tensor without changing its bytes (x += 0 on one byte per
    page), so the first transfer into freshly allocated memory does not pay the page faults
    (measured: it can halve the first transfer's bandwidth). No-op for device tensors."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    flat = tensor.reshape(-1).view(torch.uint8)
    flat[::PAGE].add_(0)
    flat[-1:].add_(0)


def tensor_region(name: str, tensor: torch.Tensor) -> RegionDesc:
    if not tensor.is_contiguous():
        raise TransferError(f"register({name!r}): tensor must be contiguous")
    length = tensor.numel() * tensor.element_size()
    if length == 0:
        raise TransferError(f"register({name!r}): tensor is empty")
    return RegionDesc(name=name, addr=tensor.data_ptr(), length=length, device=str(tensor.device))


@dataclass
class Deadline:
    """A handle's wall-clock limit: `timeout_s` plus the time the bytes need at `floor_gib_s`.
    A backstop so poll() turns a transfer that neither finishes nor fails (a peer that vanished
    mid-transfer, a transport that never reports) into FAILED instead of PENDING forever."""

    at: float

    @classmethod
    def for_bytes(cls, nbytes: int, timeout_s: float, floor_gib_s: float) -> "Deadline":
        return cls(time.monotonic() + timeout_s + nbytes / (floor_gib_s * 2**30))

    def passed(self) -> bool:
        return time.monotonic() > self.at


class HandleTable(Generic[T]):
    """A backend's open write batches by handle (ints from 1, never reused); a handle that was
    released, or never given out, is a TransferError. Thread: the backend's caller's (not locked)."""

    def __init__(self) -> None:
        self._items: dict[int, T] = {}
        self._next = 1

    def add(self, item: T) -> int:
        handle, self._next = self._next, self._next + 1
        self._items[handle] = item
        return handle

    def get(self, handle: int) -> T:
        try:
            return self._items[handle]
        except KeyError:
            raise TransferError(f"unknown or released handle {handle}") from None

    def pop(self, handle: int) -> T | None:
        """The batch of `handle`, forgotten; None if it was not open."""
        return self._items.pop(handle, None)

    def handles(self) -> list[int]:
        return list(self._items)
