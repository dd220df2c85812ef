"""TPGroup: rank 0 leads, followers follow; each group has its own process groups, so two TP
engines' rank 0 can share a process, and a follower outlives any idle time of its rank 0."""

from __future__ import annotations

import multiprocessing
import socket
import time

import pytest
import torch

from _tp_workers import follower
from k3serve.engine.tp_group import TPGroup, leader_store

pytestmark = pytest.mark.timeout(60)


def _init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_two_groups_in_one_process_and_followers_that_idle_past_the_timeout() -> None:
    ctx = multiprocessing.get_context("spawn")
    sizes, procs, groups = (2, 3), [], []
    try:
        for world_size in sizes:
            init = _init_method()
            for rank in range(1, world_size):
                procs.append(ctx.Process(target=follower, args=(rank, world_size, init, 2.0), daemon=True))
                procs[-1].start()
            groups.append(TPGroup(0, world_size, init, timeout_s=2.0))
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


def _refuses_connections(init_method: str) -> bool:
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2.0).close()
    except ConnectionRefusedError:
        return True
    return False


def test_rank_0_closes_the_rendezvous_port_once_every_rank_has_joined() -> None:
    """The store is a rendezvous only: no port of rank 0 listens for the rest of the group's life,
    and the group works without it."""
    ctx = multiprocessing.get_context("spawn")
    world_size = 3
    store, init = leader_store(world_size, "127.0.0.1")
    procs = [ctx.Process(target=follower, args=(rank, world_size, init, 5.0), daemon=True)
             for rank in range(1, world_size)]
    try:
        for proc in procs:
            proc.start()
        group = TPGroup(0, world_size, init, timeout_s=5.0, store=store)
        del store  # handed over, as rank 0's callers do
        assert _refuses_connections(init)
        group.lead(("sum",))
        assert group.tensor_parallel().all_reduce(torch.full((3,), 1.0)).tolist() == [6.0] * 3
        assert group.gather([6.0] * 3) == [[6.0] * 3] * world_size
        group.lead(("stop",))
        group.close()
        for proc in procs:
            proc.join(20)
        assert [p.exitcode for p in procs] == [0] * len(procs)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
