"""The offload tiers an engine's arguments ask for (`EngineArgs.kv_offload`): the scheduler's halves on rank 0
(`tier_indexes`) and each rank's halves in its runner (`tier_data`), sized alike from the same plan."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from k3serve.engine.offload.copy import block_bytes, slot_bytes
from k3serve.engine.offload.host_tier import HostData, HostIndex, host_pool_sizes
from k3serve.engine.offload.tier import TierData, TierIndex
from k3serve.transfer.layout import compatibility_hash

if TYPE_CHECKING:
    from k3serve.engine.config import EngineArgs
    from k3serve.engine.memory import PoolPlan
    from k3serve.model.batch import ModelCache
    from k3serve.model.config import ModelConfig
    from k3serve.model.parallel import TensorParallel


# The default host tier takes at most this share of the host's memory, split among the TP ranks
HOST_MEMORY_SHARE = 0.5


def host_memory_bytes() -> int:
    """The host's physical memory: a constant, so every call (the scheduler's index, each rank's data) sizes the
    tier alike, which the memory still free at the time of each call would not."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_pools(args: EngineArgs, cache: ModelCache, plan: PoolPlan) -> tuple[int, int]:
    """(host blocks, host slots) of the host tier, split as the device's pools are: `kv_offload_host_bytes`, or by
    default twice the device pools' bytes capped at `HOST_MEMORY_SHARE` of the host's memory per TP rank (a GPU's
    pools can outgrow the host). ValueError if an explicit size exceeds the host's memory."""
    per_block, per_slot = block_bytes(cache), slot_bytes(cache)
    total = host_memory_bytes()
    if args.kv_offload_host_bytes is not None:
        if args.kv_offload_host_bytes > total:
            raise ValueError(f"kv_offload_host_bytes={args.kv_offload_host_bytes} exceeds the host's memory "
                             f"({total / 2**30:.1f} GiB)")
        host_bytes = args.kv_offload_host_bytes
    else:
        device_bytes = plan.num_blocks * per_block + plan.num_slots * per_slot
        host_bytes = min(2 * device_bytes, int(HOST_MEMORY_SHARE * total) // args.tensor_parallel_size)
    return host_pool_sizes(host_bytes, per_block, per_slot, plan.num_blocks, plan.num_slots)


def tier_indexes(args: EngineArgs, cache: ModelCache, plan: PoolPlan, data: dict[str, TierData],
                 config: ModelConfig) -> list[TierIndex]:
    """Rank 0's scheduler halves, in lookup order; `data`: rank 0's runner halves (a store's client is shared)."""
    if args.kv_offload == "host":
        return [HostIndex(*host_pools(args, cache, plan), plan.block_size)]
    if args.kv_offload == "mooncake":
        from k3serve.engine.offload.mooncake_tier import MooncakeIndex

        compat = compatibility_hash(config, args.torch_dtype, args.block_size)
        return [MooncakeIndex(data["mooncake"].client, compat, args.tensor_parallel_size, plan.block_size)]
    return []


def tier_data(args: EngineArgs, cache: ModelCache, plan: PoolPlan, tp: TensorParallel,
              config: ModelConfig) -> list[TierData]:
    """This rank's runner halves (host memory pinned where the cache is on CUDA; a store client of its own)."""
    if args.kv_offload == "host":
        return [HostData(cache, *host_pools(args, cache, plan), pin_memory=cache.mla_kv[0].is_cuda)]
    if args.kv_offload == "mooncake":
        from k3serve.engine.offload.mooncake_config import MooncakeStoreConfig
        from k3serve.engine.offload.mooncake_tier import MooncakeClient, MooncakeData

        client = MooncakeClient(MooncakeStoreConfig.from_json(args.kv_offload_mooncake_config))
        compat = compatibility_hash(config, args.torch_dtype, args.block_size)
        return [MooncakeData(client, cache, compat, tp.world_size, tp.rank)]
    return []
