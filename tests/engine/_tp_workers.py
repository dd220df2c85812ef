"""Follower side of tests/engine/test_tp_group.py (a spawned process: importable by name)."""

from __future__ import annotations


def follower(rank: int, world_size: int, init_method: str, timeout_s: float) -> None:
    import torch

    from k3serve.engine.tp_group import TPGroup, follow_forever

    group = TPGroup(rank, world_size, init_method, timeout_s=timeout_s)
    tp = group.tensor_parallel()
    try:
        follow_forever(group, {
            "echo": lambda payload: group.gather((rank, payload)),
            "sum": lambda: group.gather(tp.all_reduce(torch.full((3,), float(rank + 1))).tolist()),
        })
    finally:
        group.close()
