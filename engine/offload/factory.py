"""The offload tiers an engine's arguments ask for (`EngineArgs.kv_offload`): the scheduler's halves on rank 0
(`tier_indexes`) and each rank's halves in its runner (`tier_data`), sized alike from the same plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3serve.engine.offload.copy import block_bytes, slot_bytes
from k3serve.engine.offload.host_tier import HostData, HostIndex, host_pool_sizes
from k3serve.engine.offload.tier import TierData, TierIndex

if TYPE_CHECKING:
    from k3serve.engine.config import EngineArgs
    from k3serve.engine.memory import PoolPlan
    from k3serve.model.batch import ModelCache
    from k3serve.model.parallel import TensorParallel


def host_pools(args: EngineArgs, cache: ModelCache, plan: PoolPlan) -> tuple[int, int]:
    """(host blocks, host slots) of the host tier: `kv_offload_host_bytes` (default: twice the device pools' bytes),
    split as the device's pools are."""
    per_block, per_slot = block_bytes(cache), slot_bytes(cache)
    host_bytes = args.kv_offload_host_bytes or 2 * (plan.num_blocks * per_block + plan.num_slots * per_slot)
    return host_pool_sizes(host_bytes, per_block, per_slot, plan.num_blocks, plan.num_slots)


def tier_indexes(args: EngineArgs, cache: ModelCache, plan: PoolPlan) -> list[TierIndex]:
    """Rank 0's scheduler halves, in lookup order."""
    if args.kv_offload == "host":
        return [HostIndex(*host_pools(args, cache, plan), plan.block_size)]
    return []


def tier_data(args: EngineArgs, cache: ModelCache, plan: PoolPlan, tp: TensorParallel) -> list[TierData]:
    """This rank's runner halves (host memory pinned where the cache is on CUDA)."""
    if args.kv_offload == "host":
        return [HostData(cache, *host_pools(args, cache, plan), pin_memory=cache.mla_kv[0].is_cuda)]
    return []
