"""A prefill engine's rank > 0: a model shard, a cache shard, a transfer agent, and a loop that
performs whatever rank 0 announces (steps and handoffs). Started as a process (`--launcher
local`) or inside a Ray actor, before rank 0 is constructed (the group forms when all have joined).
"""

from __future__ import annotations

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import resolve_model_dir
from k3serve.engine.runner import load_runner
from k3serve.engine.tp_group import TPGroup, follow_forever
from k3serve.model.config import ModelConfig
from k3serve.prefill.worker import make_sender


def follower_main(
    rank: int, args: EngineArgs, init_method: str, transfer: str, transfer_options: dict | None = None,
    num_threads: int | None = None,
) -> None:
    import torch

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    group = TPGroup(rank, args.tensor_parallel_size, init_method)
    try:
        kind, plan = group.follow()
        if kind != "plan":
            raise RuntimeError(f"rank {rank} expected the pool plan first, got {kind!r}")
        model_dir = resolve_model_dir(args.model, args.seed, args.model_cache_dir)
        runner = load_runner(args, model_dir, plan, group.tensor_parallel(), group)
        sender = make_sender(args, runner, ModelConfig.from_dir(model_dir), rank, transfer, transfer_options)
        try:
            follow_forever(group, {
                "step": lambda output, want: runner.execute(output, want),
                "handoff": lambda job: group.gather(sender.push(job)),
            })
        finally:
            sender.close()
    finally:
        group.close()
