"""`PinManager`: holds a request's boundary state pinned, under a lease, while its async writes are in flight.

From the moment a transfer is posted until every sending rank has confirmed its writes, the request's MLA
blocks and KDA slots must not be reused, even if the request itself finished or was aborted (a reused slot is
how decode ends up serving freed state with HTTP 200, PD_PRIOR_ART §7.1). The pools enforce "pinned => never
handed out" (through the seam's `StatePins`); this class decides when to unpin, exactly once per lease: when
every expected rank confirmed, on abort, when a peer is lost, or when the lease expires. The lease lifecycle is
drawn in docs/design/handoff.md. One manager per engine (all TP ranks share block and slot ids), called on
its engine thread; the clock is injectable so tests drive time by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from k3serve.transfer.metrics import BoundTransferMetrics, transfer_metrics


class StatePins(Protocol):
    """What pins an engine's blocks and slots (`engine.kv_handoff.PoolPins`)."""

    def pin(self, block_ids: Sequence[int], slot_ids: Sequence[int]) -> None:
        """All or nothing: raises (a bad id) with nothing pinned."""

    def unpin(self, block_ids: Sequence[int], slot_ids: Sequence[int]) -> None: ...


@dataclass
class Lease:
    """One request's pins and who still has to confirm."""

    request_id: str
    block_ids: tuple[int, ...]  # [num_blocks] pinned MLA blocks
    slot_ids: tuple[int, ...]  # [num_slots] pinned KDA slots (working slot, checkpoints)
    expected_ranks: frozenset[int]  # ranks whose writes must finish
    peers: frozenset[str]  # peer endpoints/replicas the writes go to
    lease_seconds: float
    num_bytes: int  # bytes the writes carry, counted in k3serve:transfer_bytes_total when confirmed
    started_at: float
    deadline: float
    confirmed_ranks: set[int] = field(default_factory=set)

    @property
    def missing_ranks(self) -> set[int]:
        return set(self.expected_ranks - self.confirmed_ranks)


class PinManager:
    def __init__(
        self, pins: StatePins, clock: Callable[[], float] = time.monotonic, metrics: BoundTransferMetrics | None = None
    ) -> None:
        self.pins = pins
        self.clock = clock
        self.metrics = metrics if metrics is not None else transfer_metrics().bind()
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0  # leases released by expire(), since construction

    # -- queries ----------------------------------------------------------------------------------
    def lease(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self._leases.values())

    @property
    def num_pinned_slots(self) -> int:
        return sum(len(lease.slot_ids) for lease in self._leases.values())

    # -- lifecycle --------------------------------------------------------------------------------
    def pin(
        self,
        request_id: str,
        block_ids: Sequence[int],
        slot_ids: Sequence[int],
        expected_ranks: Iterable[int],
        lease_seconds: float,
        peers: Iterable[str] = (),
        num_bytes: int = 0,
    ) -> Lease:
        """Pin the blocks and slots now (call before posting the writes); returns the lease."""
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} already holds a transfer lease")
        expected = frozenset(expected_ranks)
        if not expected:
            raise ValueError("a lease needs at least one expected rank")
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
        self.pins.pin(block_ids, slot_ids)
        now = self.clock()
        lease = Lease(
            request_id=request_id,
            block_ids=tuple(block_ids),
            slot_ids=tuple(slot_ids),
            expected_ranks=expected,
            peers=frozenset(peers),
            lease_seconds=lease_seconds,
            num_bytes=num_bytes,
            started_at=now,
            deadline=now + lease_seconds,
        )
        self._leases[request_id] = lease
        self.metrics.pins_changed(len(lease.block_ids), len(lease.slot_ids))
        return lease

    def confirm(self, request_id: str, rank: int) -> bool:
        """Rank `rank` finished its writes. True when this was the last one (the pins are gone).
        A confirmation for an unknown (already released) request is ignored: False."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        if rank not in lease.expected_ranks:
            raise ValueError(f"rank {rank} is not expected for {request_id!r} (expected {sorted(lease.expected_ranks)})")
        lease.confirmed_ranks.add(rank)
        if lease.missing_ranks:
            return False
        self._release(request_id)
        self.metrics.observe_seconds(self.clock() - lease.started_at)
        self.metrics.add_bytes(lease.num_bytes)
        return True

    def heartbeat(self, request_id: str) -> bool:
        """Extend the lease by its length from now. False if the lease is already gone."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        lease.deadline = self.clock() + lease.lease_seconds
        return True

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Release now, without confirmation. False if there was nothing to release."""
        if self._release(request_id) is None:
            return False
        self.metrics.failure(reason)
        return True

    def peer_lost(self, peer: str) -> list[str]:
        """Release every lease whose writes go to `peer`; returns their request ids."""
        lost = [rid for rid, lease in self._leases.items() if peer in lease.peers]
        for request_id in lost:
            self.abort(request_id, "peer_lost")
        return lost

    def expire(self, now: float | None = None) -> list[str]:
        """Release every lease past its deadline; returns their request ids."""
        now = self.clock() if now is None else now
        expired = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
        for request_id in expired:
            self.abort(request_id, "lease_expired")
            self.metrics.lease_expired()
        self.num_expired += len(expired)
        return expired

    def release_all(self, reason: str = "shutdown") -> int:
        """Release every lease (engine shutdown); returns how many."""
        ids = list(self._leases)
        for request_id in ids:
            self.abort(request_id, reason)
        return len(ids)

    # -- internals --------------------------------------------------------------------------------
    def _release(self, request_id: str) -> Lease | None:
        """The single unpin path: pops the lease first, so nothing can unpin it twice."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return None
        self.pins.unpin(lease.block_ids, lease.slot_ids)
        self.metrics.pins_changed(-len(lease.block_ids), -len(lease.slot_ids))
        return lease
