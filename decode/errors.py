"""What a decode worker raises that its callers catch across processes: plain exceptions, so the router imports
them without the worker (and its torch)."""

from __future__ import annotations


class UnknownFeedError(RuntimeError):
    """`admit` named a feed this worker does not serve (its stream ended, or this is a restarted
    process): every request the caller routed through that feed is gone."""
