"""What every rank > 0 of a TP engine does first: join rank 0's group, take its pool plan, load
this rank's model and cache shards. The prefill and decode followers add their transfer side."""

from __future__ import annotations

from k3serve.engine.config import EngineArgs
from k3serve.model.packaged import resolve_model_dir
from k3serve.engine.runner import ModelRunner, load_runner
from k3serve.engine.tp_group import TPGroup
from k3serve.model.config import ModelConfig


def join_engine(
    rank: int, args: EngineArgs, init_method: str, num_threads: int | None = None, host: str = "127.0.0.1"
) -> tuple[TPGroup, ModelRunner, ModelConfig]:
    """Returns (group, runner, config); the caller must `group.close()` when done. `host`: this
    node's address, where this rank's group sockets listen."""
    import torch

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    group = TPGroup(rank, args.tensor_parallel_size, init_method, host=host)
    try:
        kind, plan = group.follow()
        if kind != "plan":
            raise RuntimeError(f"rank {rank} expected the pool plan first, got {kind!r}")
        model_dir = resolve_model_dir(args.model, args.seed, args.model_cache_dir)
        runner = load_runner(args, model_dir, plan, group.tensor_parallel(args.device), group)
        return group, runner, ModelConfig.from_dir(model_dir)
    except BaseException:
        group.close()
        raise
