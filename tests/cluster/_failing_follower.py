"""Followers that fail as they start, in place of `prefill.rank.follower_main` / `decode.rank.follower_main`
in a real spawned follower process (the test module passes them to the launcher; the child imports this
small module, not the test's)."""

from __future__ import annotations

import os
from typing import Callable


def raise_at_start(rank: int, *args, on_started: Callable[[], None] | None = None) -> None:
    raise RuntimeError(f"rank {rank} found no device to run on")


def raise_after_joining(rank: int, args, init_method: str, *rest, on_started: Callable[[], None] | None = None) -> None:
    """Joins rank 0's group and loads its shard as the real follower does, then fails."""
    from k3serve.engine.follower import join_engine

    group, _, _ = join_engine(rank, args, init_method)
    group.close()
    raise RuntimeError(f"rank {rank} ran out of memory after loading its shard")


def exit_at_start(rank: int, *args, on_started: Callable[[], None] | None = None) -> None:
    os._exit(3)  # dies without a word: no exception, no report


class FailsToLoad:
    """An argument that pickles in the launcher and fails to load in the follower's process, as code that
    does not import there would."""

    def __reduce__(self):
        return _missing_library, ("libfollower.so",)


def _missing_library(name: str) -> None:
    raise ImportError(f"{name}: cannot open shared object file")


class RankActorFailingToStart:
    """A Ray TP follower (in place of `cluster.actors.DecodeRankActor`, made a Ray actor by the test) whose
    run fails as it starts."""

    def run(self, rank: int, *args, **kwargs) -> None:
        raise RuntimeError(f"rank {rank} found no device to run on")
