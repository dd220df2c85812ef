"""TPGroup: rank 0 leads, followers follow; each group has its own process groups, so two TP
engines' rank 0 can share a process, a follower outlives any idle time of its rank 0, and rank 0's
rendezvous port is closed once every rank has joined; a rank that never arrives fails the others'
join with an error naming the group (within the join timeout, not the followers' idle one)."""

from __future__ import annotations

import datetime
import multiprocessing
import socket
import threading
import time

import pytest
import torch

from _local_ranks import tcp_init_method
from _tp_workers import follower
from k3serve.engine import tp_group
from k3serve.engine.tp_group import TPGroup, leader_store

pytestmark = pytest.mark.timeout(60)


def _refuses_connections(init_method: str) -> bool:
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2.0).close()
    except ConnectionRefusedError:
        return True
    return False


def test_two_groups_in_one_process_without_their_rendezvous_port_and_followers_that_idle() -> None:
    """Once every rank has joined, nothing listens on the group's address any more (the store was
    the rendezvous only), whether rank 0 opened it itself (world size 2) or was handed a client of
    `leader_store`'s, as deployments do (world size 3); the groups work on regardless."""
    ctx = multiprocessing.get_context("spawn")
    sizes, procs, groups = (2, 3), [], []
    try:
        for world_size in sizes:
            store, init = leader_store(world_size, "127.0.0.1") if world_size == 3 else (None, tcp_init_method())
            for rank in range(1, world_size):
                procs.append(ctx.Process(target=follower, args=(rank, world_size, init, 2.0), daemon=True))
                procs[-1].start()
            groups.append(TPGroup(0, world_size, init, timeout_s=2.0, store=None if store is None else store.clone()))
            del store  # every rank joined
            assert _refuses_connections(init)
        for round_ in range(2):
            for group in groups:
                group.lead(("echo", {"round": round_, "big": "x" * (round_ * 100_000)}))
                got = group.gather((0, {"round": round_}))
                assert [r for r, _ in got] == list(range(group.world_size))
                assert all(p["round"] == round_ for _, p in got)
                group.lead(("sum",))
                total = float(sum(range(1, group.world_size + 1)))
                mine = group.tensor_parallel().all_reduce(torch.full((3,), 1.0)).tolist()
                assert mine == [total] * 3
                assert group.gather(mine) == [[total] * 3] * group.world_size
            if round_ == 0:
                time.sleep(3.0)  # idle longer than the groups' 2 s timeout: the followers keep waiting
        for group in groups:
            group.lead(("stop",))
            group.close()
        for proc in procs:
            proc.join(20)
        assert [p.exitcode for p in procs] == [0] * len(procs)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()


def test_a_rank_that_never_joins_fails_rank_0_within_the_join_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp_group, "_JOIN_TIMEOUT", datetime.timedelta(seconds=1))
    store, init = leader_store(2, "127.0.0.1")
    outcome: list[BaseException | TPGroup] = []

    def join() -> None:
        try:
            outcome.append(TPGroup(0, 2, init, timeout_s=1.0, store=store.clone()))
        except BaseException as e:
            outcome.append(e)

    joining = threading.Thread(target=join, daemon=True)
    joining.start()
    joining.join(timeout=10.0)
    assert not joining.is_alive(), "rank 0 still waits for a rank that never comes"
    (error,) = outcome
    assert isinstance(error, RuntimeError)
    assert f"TP group at {init}: rank 0 of 2 did not meet every other rank within 1 s" in str(error)
