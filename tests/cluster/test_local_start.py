"""Starting a deployment with the local launcher (cluster/serve.py `_start_local`,
cluster/local_followers.py), when something fails part-way.

Spec:
- a TP engine's follower process that fails as it starts, before or after it joined rank 0, fails the
  start at once (not at rank 0's join timeout of 10 minutes) with an error naming the engine, the rank and
  the cause; one that dies without a word is reported with its exit code;
- what had started is stopped: the workers already built are shut down (no engine thread is left) and
  no follower process is left;
- a follower whose code does not load in its process is reported, with why, before rank 0 joins;
- while rank 0 joins its group, a follower that dies is reported at once, rank 0's join left alone;
- a follower failing once its code loaded, before it joined, fails the start and aborts rank 0's join
  under way: its thread ends at once, not at the join timeout;
- a deployment whose followers started shuts down leaving no engine thread and no process behind.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
from pathlib import Path

import pytest

from k3serve.cluster import serve
from k3serve.cluster.config import ServeConfig
from k3serve.cluster.local_followers import FollowerProcesses, start_tp_engine
from k3serve.decode import rank as decode_rank
from k3serve.engine import tp_group
from k3serve.transfer.backends import available_backends

import _failing_follower

pytestmark = pytest.mark.timeout(60)

BACKEND = next((b for b in ("mooncake", "nixl") if available_backends().get(b)), None)
ENGINE = dict(block_size=16, max_model_len=256, cache_memory_bytes=16 << 20)


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "k3serve-engine"]


@pytest.mark.skipif(BACKEND is None, reason="TP > 1 needs the mooncake or nixl backend")
@pytest.mark.parametrize(("follower", "cause"), [
    (_failing_follower.FailsToLoad(), "ImportError: libfollower.so: cannot open shared object file"),
    (_failing_follower.raise_after_joining, "RuntimeError: rank 1 ran out of memory after loading its shard"),
], ids=["before-joining", "after-joining"])
def test_a_follower_failing_at_start_fails_the_start_at_once_and_what_started_is_stopped(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, follower, cause: str
) -> None:
    """prefill-0 (TP 1) starts; decode-0's rank 1 fails as it starts: its code does not load in its process,
    or it fails once it has joined rank 0 and loaded its shard (rank 0 is building its worker then)."""
    monkeypatch.setattr(decode_rank, "follower_main", follower)
    config = ServeConfig(model=str(tiny_checkpoint), launcher="local", transfer=BACKEND, decode_tp=2, **ENGINE)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"^decode-0: TP rank 1 failed to start: {re.escape(cause)}$"):
        serve.start_deployment(config)
    assert time.monotonic() - began < 30 < tp_group._JOIN_TIMEOUT.total_seconds()
    assert _engine_threads() == []  # prefill-0 and decode-0's rank 0 were shut down
    assert multiprocessing.active_children() == []


def test_a_follower_whose_code_does_not_load_is_reported_before_rank_0_joins() -> None:
    followers = FollowerProcesses("decode-1", 2, _failing_follower.raise_at_start,
                                  lambda rank: (rank, _failing_follower.FailsToLoad()))
    try:
        with pytest.raises(RuntimeError, match=r"^decode-1: TP rank 1 failed to start: "
                                               r"ImportError: libfollower.so: cannot open shared object file$"):
            followers.wait_until("arrived")
    finally:
        followers.kill()
    assert multiprocessing.active_children() == []


def test_a_follower_dying_while_rank_0_joins_is_reported_at_once() -> None:
    followers = FollowerProcesses("prefill-3", 3, _failing_follower.exit_at_start, lambda rank: (rank,))
    joining = threading.Event()  # stands in for rank 0's TPGroup(): it would wait for the dead rank
    try:
        with pytest.raises(RuntimeError, match=r"^prefill-3: TP rank [12] failed to start: "
                                               r"its process exited \(exit code 3\) before it started$"):
            followers.while_watching(joining.wait)
    finally:
        followers.kill()
        joining.set()
    assert multiprocessing.active_children() == []


def test_a_follower_failing_before_it_joins_aborts_rank_0s_join() -> None:
    def build(group: tp_group.TPGroup) -> None:
        raise AssertionError("rank 0 joined a group whose rank 1 never came")

    with pytest.raises(RuntimeError, match=r"^decode-2: TP rank 1 failed to start: "
                                           r"RuntimeError: rank 1 found no device to run on$"):
        start_tp_engine("decode-2", 2, "127.0.0.1", _failing_follower.raise_at_start, lambda rank, init: (rank,), build)
    joining = [t for t in threading.enumerate() if t.name == "decode-2-rank0-join"]  # rank 0's, if not ended yet
    for thread in joining:
        thread.join(10.0)
    assert not any(t.is_alive() for t in joining), "rank 0's join waits out the join timeout for rank 1"
    assert multiprocessing.active_children() == []


@pytest.mark.skipif(BACKEND is None, reason="TP > 1 needs the mooncake or nixl backend")
def test_a_tp_deployment_starts_and_shuts_down_leaving_nothing_behind(tiny_checkpoint: Path) -> None:
    config = ServeConfig(model=str(tiny_checkpoint), launcher="local", transfer=BACKEND, decode_tp=2, **ENGINE)
    deployment = serve.start_deployment(config)
    try:
        assert len(multiprocessing.active_children()) == 1  # decode-0's rank 1
        assert len(_engine_threads()) == 2  # prefill-0, decode-0
    finally:
        deployment.shutdown()
    assert _engine_threads() == []
    assert multiprocessing.active_children() == []
