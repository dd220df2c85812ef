"""Per-rank memory accounting: weights, MLA latent KV per token, KDA state per request.

The same numbers size the engine's pools and answer `k3serve plan`, so an operator can check
that a deployment of the published K3 fits before renting the hardware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3serve.model.config import ModelConfig


@dataclass(frozen=True)
class CacheSizes:
    mla_bytes_per_token: int  # all MLA layers, replicated on every rank
    kda_bytes_per_slot: int  # all KDA layers, this rank's heads: recurrent fp32 + conv window
    weight_bytes: int  # this rank's weights as loaded (MXFP4 experts packed)


def cache_sizes(config: ModelConfig, tp_size: int, dtype: torch.dtype) -> CacheSizes:
    itemsize = torch.empty((), dtype=dtype).element_size()
    h_local, d = config.kda.num_heads // tp_size, config.kda.head_dim
    recurrent = h_local * d * d * 4
    conv = 3 * h_local * d * (config.kda.conv_kernel_size - 1) * itemsize
    return CacheSizes(
        mla_bytes_per_token=len(config.mla_layers) * config.mla_kv_dim * itemsize,
        kda_bytes_per_slot=len(config.kda_layers) * (recurrent + conv),
        weight_bytes=weight_bytes(config, tp_size, dtype),
    )


def weight_bytes(config: ModelConfig, tp_size: int, dtype: torch.dtype) -> int:
    """Bytes of rank 0's weights, counted on the meta device (nothing is allocated): the loaded tensors
    plus what `process_weights_after_loading` derives from them (e.g. K3's fp32 router weights, ~1.4 GiB
    a rank), each storage once (a derived tensor may be a view of its source)."""
    from k3serve.model.model import KimiForCausalLM
    from k3serve.model.parallel import TensorParallel

    with torch.device("meta"):
        model = KimiForCausalLM(config, TensorParallel(0, tp_size), dtype)
        model.process_weights_after_loading()
    derived = [t for m in model.modules() for v in vars(m).values()
               for t in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers(), *derived]}
    return sum(storages.values())


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    num_slots: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_pools(
    sizes: CacheSizes, cache_bytes: int, block_size: int, num_slots: int, max_model_len: int
) -> PoolPlan:
    """Give `num_slots` KDA slots their bytes, the rest of `cache_bytes` to MLA blocks."""
    slot_bytes = num_slots * sizes.kda_bytes_per_slot
    block_bytes = block_size * sizes.mla_bytes_per_token
    num_blocks = (cache_bytes - slot_bytes) // block_bytes if block_bytes else 0
    needed = math.ceil(max_model_len / block_size)
    if num_blocks < needed:
        raise ValueError(
            f"a cache budget of {cache_bytes / 2**20:.1f} MiB holds {max(num_blocks, 0)} blocks of {block_size} tokens "
            f"after {num_slots} KDA slots ({slot_bytes / 2**20:.1f} MiB); one request of max_model_len={max_model_len} "
            f"needs {needed} blocks. Raise the cache budget or lower max_model_len / max_num_seqs."
        )
    return PoolPlan(num_blocks=int(num_blocks), num_slots=num_slots, block_size=block_size)


def describe_plan(
    config: ModelConfig, tp_size: int, dtype: torch.dtype, device_bytes: int, utilization: float, max_num_seqs: int
) -> list[tuple[str, str]]:
    """Rows of `k3serve plan`: what one rank holds and how much context fits beside the weights."""
    config.check_tp(tp_size)
    sizes = cache_sizes(config, tp_size, dtype)
    budget = int(device_bytes * utilization) - sizes.weight_bytes
    slots_bytes = max_num_seqs * sizes.kda_bytes_per_slot
    kv_bytes = budget - slots_bytes
    gib = 2**30
    rows = [
        ("tensor-parallel ranks", str(tp_size)),
        ("device memory x utilization", f"{device_bytes / gib:.1f} GiB x {utilization:.2f}"),
        ("weights per rank (MXFP4 experts packed)", f"{sizes.weight_bytes / gib:.2f} GiB"),
        ("MLA latent KV per token (all MLA layers)", f"{sizes.mla_bytes_per_token / 1024:.1f} KiB"),
        ("KDA state per request (this rank's heads)", f"{sizes.kda_bytes_per_slot / 2**20:.1f} MiB"),
        (f"KDA slots for max_num_seqs={max_num_seqs}", f"{slots_bytes / gib:.2f} GiB"),
    ]
    if kv_bytes <= 0:
        rows.append(("fits", f"NO: weights + KDA slots exceed the budget by {-kv_bytes / gib:.2f} GiB"))
        return rows
    tokens = kv_bytes // sizes.mla_bytes_per_token
    rows += [
        ("left for MLA KV", f"{kv_bytes / gib:.2f} GiB"),
        ("tokens of context that fit", f"{tokens:,}"),
        ("average context per running request", f"{tokens // max_num_seqs:,} tokens"),
    ]
    return rows
