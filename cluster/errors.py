"""The errors the serving backends raise when they cannot take a request now: the router, its admission queue
and the replica handles. The HTTP layer (`cluster/api`) answers each with 503; nothing here knows about HTTP."""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """An `EngineClient` cannot take the request now (no capacity, its queue full or timed out)."""


class ReplicaUnavailableError(EngineOverloadedError):
    """No healthy replica could serve the request."""


class PoolDegradedError(ReplicaUnavailableError):
    """The decode replicas answer, but none can admit a request (`cluster/room_watch.py`)."""


class ReplicaDiedError(EngineOverloadedError):
    """The replica's process died during the call (Ray restarts the actor)."""
