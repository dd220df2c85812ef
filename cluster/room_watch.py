"""`RoomWatch`: which decode replicas answer their stats but cannot admit work, so that /health and
`k3serve:replicas_healthy` say so rather than staying green while every request waits out the admission queue
(issue 27: 128 Reserve calls on the control plane took every KDA slot, and chats got 503 after 60 s).

A replica is stalled when, for `stall_seconds`, every stats refresh found it without room for a request (no free
KDA slot or no free MLA block), that room held by reservations awaiting their handoff, with the same counts of
reservations and running requests each time, and this router admitted nothing there. Room held by running
requests is not a stall (they end: a long generation fills a replica for minutes); nor is room that moves
(reservations handed off, requests ending and others admitted: the pool admits work, only slowly). Anything else
that changes clears it: room seen, the counts moving, an admission. The router observes every refresh (`observe`),
and clears a replica on each admission there and when it stops answering (`clear`), on the event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from k3serve.engine.outputs import EngineStats

STALL_SECONDS = 10.0
"""The default: well below the admission queue's 60 s timeout (a load balancer moves traffic away before the
queued requests fail), well above a refresh period or a prefill's handoff."""


@dataclass(frozen=True)
class _Held:
    since: float  # first refresh that found the room held so
    num_reserved: int
    num_running: int


class RoomWatch:
    def __init__(self, stall_seconds: float = STALL_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        if stall_seconds <= 0:
            raise ValueError(f"admission_stall_seconds must be > 0, got {stall_seconds!r}")
        self.stall_seconds, self.clock = stall_seconds, clock
        self._held: dict[str, _Held] = {}

    def observe(self, replica: str, stats: "EngineStats") -> None:
        """A stats refresh of `replica`."""
        full = stats.num_free_slots == 0 or stats.num_free_blocks == 0
        if not full or stats.num_reserved == 0:
            self._held.pop(replica, None)
            return
        held = self._held.get(replica)
        if held is None or (held.num_reserved, held.num_running) != (stats.num_reserved, stats.num_running):
            self._held[replica] = _Held(self.clock(), stats.num_reserved, stats.num_running)

    def clear(self, replica: str) -> None:
        """This router admitted a request on `replica` (it had room), or `replica` stopped answering (it is
        unhealthy, which the router tracks itself, rather than stalled)."""
        self._held.pop(replica, None)

    def stall(self, replica: str) -> str | None:
        """Why `replica` cannot admit (for /health), or None when it is not stalled."""
        held = self._held.get(replica)
        if held is None or self.clock() - held.since < self.stall_seconds:
            return None
        return (f"{replica}: no room for {self.clock() - held.since:.0f} s, held by {held.num_reserved} reservations "
                f"that have not moved (admission_stall_seconds {self.stall_seconds:g})")
