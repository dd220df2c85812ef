"""Per-rank memory accounting: weights, MLA latent KV per token, KDA state per request, and with CUDA
graphs the pad KDA slot and the graphs' memory.

The same numbers size the engine's pools and answer `k3serve plan`, so an operator can check
that a deployment of the published K3 fits before renting the hardware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3serve.engine.config import DEFAULT_CPU_CACHE_BYTES, EngineArgs
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
    plus what `process_weights_after_loading` derives from them (e.g. the MLA layers' fp32 W_UK / W_UV, 4 MiB
    a layer at K3 TP8), each storage once (a derived tensor may be a view of its source)."""
    from k3serve.model.model import KimiForCausalLM
    from k3serve.model.parallel import TensorParallel

    with torch.device("meta"):
        model = KimiForCausalLM(config, TensorParallel(0, tp_size), dtype)
        model.process_weights_after_loading()
    return sum(storage_bytes(held_tensors(model)).values())


def held_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a model holds: parameters, buffers and the forms derived at load, kept in module
    attributes alone or in tuples / lists (views of one another included)."""
    derived = [t for m in model.modules() for v in vars(m).values()
               for t in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(t, torch.Tensor)]
    return [*model.parameters(), *model.buffers(), *derived]


def storage_bytes(tensors: list[torch.Tensor]) -> dict[int, int]:
    """Storage id -> bytes, each storage once however many tensors view it (works on "meta" too)."""
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    num_slots: int  # KDA slots the state pool hands out
    block_size: int
    pad_slot: bool = False  # one more KDA slot in the cache, for CUDA-graph padding rows (no request owns it)
    graph_bytes: int = 0  # set aside for the captured decode graphs out of a device budget (`graph_reserve_bytes`)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_pools(
    sizes: CacheSizes, cache_bytes: int, block_size: int, num_slots: int, max_model_len: int,
    pad_slot: bool = False, graph_bytes: int = 0,
) -> PoolPlan:
    """Give `num_slots` KDA slots (plus the pad slot) and `graph_bytes` their bytes, the rest of `cache_bytes`
    to MLA blocks."""
    slot_bytes = (num_slots + pad_slot) * sizes.kda_bytes_per_slot
    block_bytes = block_size * sizes.mla_bytes_per_token
    num_blocks = (cache_bytes - slot_bytes - graph_bytes) // block_bytes if block_bytes else 0
    needed = math.ceil(max_model_len / block_size)
    if num_blocks < needed:
        graphs = f" and {graph_bytes / 2**20:.1f} MiB for CUDA graphs" if graph_bytes else ""
        raise ValueError(
            f"a cache budget of {cache_bytes / 2**20:.1f} MiB holds {max(num_blocks, 0)} blocks of {block_size} tokens "
            f"after {num_slots + pad_slot} KDA slots ({slot_bytes / 2**20:.1f} MiB){graphs}; one request of "
            f"max_model_len={max_model_len} needs {needed} blocks. Raise the cache budget or lower max_model_len / "
            "max_num_seqs."
        )
    return PoolPlan(num_blocks=int(num_blocks), num_slots=num_slots, block_size=block_size, pad_slot=pad_slot,
                    graph_bytes=graph_bytes)


def plan_engine_pools(config: ModelConfig, args: EngineArgs, usable_bytes: int | None = None) -> PoolPlan:
    """The pools of an engine run with `args`: in `cache_memory_bytes` when given (MLA blocks and KDA slots);
    else in `usable_bytes` (on CUDA: what `gpu_memory_utilization` leaves of the free memory) less this
    engine's weights (planned before they load) and the captured graphs' memory; else the CPU default.
    With CUDA graphs (`graphs_allowed(args)`: not under `enforce_eager`, ...) the cache holds the pad slot
    too; at TP > 1 only where NCCL is asked for (`K3SERVE_TP_NCCL=1`: gloo's collectives cannot be recorded).
    The plan is made before the ranks join: should NCCL be refused there (ranks sharing a GPU,
    `engine/tp_group.py`), what was set aside for them stays unused. NCCL's own buffers, not counted here,
    come out of what `gpu_memory_utilization` leaves free (they are made after the plan)."""
    from k3serve.engine.cuda_graphs import graphs_allowed

    sizes = cache_sizes(config, args.tensor_parallel_size, args.torch_dtype)
    graphs = graphs_allowed(args)
    graph_bytes = 0
    if args.cache_memory_bytes is not None:
        cache_bytes = args.cache_memory_bytes
    elif usable_bytes is not None:
        graph_bytes = graph_reserve_bytes(config, args) if graphs else 0
        cache_bytes = usable_bytes - sizes.weight_bytes
    else:
        cache_bytes = DEFAULT_CPU_CACHE_BYTES
    return plan_pools(sizes, cache_bytes, args.block_size, args.kda_slots, args.max_model_len, pad_slot=graphs,
                      graph_bytes=graph_bytes)


GRAPH_POOL_SLACK_BYTES = 64 * 2**20


def graph_reserve_bytes(config: ModelConfig, args: EngineArgs) -> int:
    """Device memory of the captured decode graphs: their fixed-address inputs and output (exact) and an
    estimate of their private memory pool.

    The pool holds what the recorded step allocates. Blocks freed during a capture are reused later in the
    same capture, and every bucket records into one pool (only one replays at a time), so the largest
    bucket's activation workspace sizes it: `decode_activation_bytes` per row (generous: everything a layer
    makes counted live at once) times the rows, plus `GRAPH_POOL_SLACK_BYTES` for what does not grow with
    the rows: the MLA decode's split-K partials (the kernel sizes its splits to ~2 waves of programs:
    2 x 132 SMs x 16 heads x 512 x 4 B = 8.3 MiB on an H200), cuBLAS's workspace for the capture stream
    (8 to 32 MiB by GPU) and the caching allocator's rounding (2 MiB segments for small blocks, 20 MiB for
    mid-sized ones). vLLM measures its graphs' pool instead, by capturing before it sizes the KV cache;
    capture here needs the cache, so the plan estimates, and `benchmarks/gpu_engine.py` reports the
    estimate beside what a capture really holds (not yet measured). At TP > 1 the rows are this rank's
    shard's (`args.tensor_parallel_size`); the recorded all-reduces work in place, taking nothing from the
    pool (NCCL keeps a small work buffer of its own per recorded collective, outside it)."""
    from k3serve.model.batch import StaticDecodeInputs

    rows = args.graph_batch_sizes[-1]
    itemsize = torch.empty((), dtype=args.torch_dtype).element_size()
    inputs = StaticDecodeInputs(rows, math.ceil(args.max_model_len / args.block_size), args.block_size, 0, "meta")
    output = rows * config.hidden_size * itemsize
    activations = rows * decode_activation_bytes(config, args.tensor_parallel_size, args.torch_dtype)
    return inputs.device_bytes + output + activations + GRAPH_POOL_SLACK_BYTES


def decode_activation_bytes(config: ModelConfig, tp_size: int, dtype: torch.dtype) -> int:
    """Bytes one decode row's step allocates, counted generously: the residual stream (the attention-residual
    bank) held through the step, plus everything the widest layer part makes counted live at once, fp32
    where the layer computes in fp32."""
    b = torch.empty((), dtype=dtype).element_size()
    hidden = config.hidden_size
    bank = -(-config.num_hidden_layers // config.attn_res_block_size) + 1 if config.attn_res_block_size else 1
    stream = (bank + 3) * hidden * b  # the bank, a layer's input, its mixer's and its MLP's outputs
    p = config.kda.num_heads // tp_size * config.kda.head_dim
    kda = p * (10 * b + 4) + hidden * b  # projections, conv, q/k/v, gate (fp32), outputs, o_proj
    h, latent = config.num_attention_heads // tp_size, config.kv_lora_rank
    q_width = h * config.qk_head_dim
    mla = ((config.q_lora_rank or 0) + 2 * q_width + 2 * config.mla_kv_dim + h * config.v_head_dim) * b \
        + h * latent * (4 + b) + 2 * h * config.v_head_dim * 4 + hidden * b  # q, latent, absorbed q, o, gate
    dense = 3 * config.intermediate_size // tp_size * b + hidden * b
    moe = 0
    if config.num_experts:
        width = config.routed_expert_hidden_size or hidden
        shared = config.moe_intermediate_size * config.num_shared_experts // tp_size
        top_k = config.num_experts_per_token
        moe = (config.num_experts * 4 + top_k * 16  # router logits fp32, top-k weights and ids
               + width * (2 * b + 4) + top_k * config.moe_intermediate_size * b  # expert input, h, fp32 sum, norm
               + 3 * shared * b + hidden * (2 * b + 4))  # shared experts, up-projection, fp32 shared sum
    return stream + max(kda, mla, dense, moe)


def describe_plan(config: ModelConfig, args: EngineArgs, device_bytes: int) -> list[tuple[str, str]]:
    """Rows of `k3serve plan`: what one rank of an engine run with `args` holds and how much context fits
    beside the weights (the engine's KDA slots, `args.kda_slots`: one per running request, and with prefix
    caching as many for its checkpoints; the pad slot and the graphs' memory when `args` allow CUDA graphs)."""
    from k3serve.engine.cuda_graphs import graphs_allowed

    tp_size, utilization, max_num_seqs = args.tensor_parallel_size, args.gpu_memory_utilization, args.max_num_seqs
    config.check_tp(tp_size)
    sizes = cache_sizes(config, tp_size, args.torch_dtype)
    budget = int(device_bytes * utilization) - sizes.weight_bytes
    graphs = graphs_allowed(args)
    graph_bytes = graph_reserve_bytes(config, args) if graphs else 0
    slots = args.kda_slots + graphs
    slots_bytes = slots * sizes.kda_bytes_per_slot
    kv_bytes = budget - slots_bytes - graph_bytes
    gib = 2**30
    rows = [
        ("tensor-parallel ranks", str(tp_size)),
        ("device memory x utilization", f"{device_bytes / gib:.1f} GiB x {utilization:.2f}"),
        ("weights per rank (MXFP4 experts packed)", f"{sizes.weight_bytes / gib:.2f} GiB"),
        ("MLA latent KV per token (all MLA layers)", f"{sizes.mla_bytes_per_token / 1024:.1f} KiB"),
        ("KDA state per request (this rank's heads)", f"{sizes.kda_bytes_per_slot / 2**20:.1f} MiB"),
        (f"KDA slots for max_num_seqs={max_num_seqs}"
         + (" and prefix-cache checkpoints" if args.kda_slots > max_num_seqs else "")
         + (" + the CUDA-graph pad slot" if graphs else ""),
         f"{slots} slots, {slots_bytes / gib:.2f} GiB"),
        ("CUDA graphs (decode, up to batch "
         f"{args.graph_batch_sizes[-1]}: inputs, output, pool estimate)" if graphs else "CUDA graphs",
         f"{graph_bytes / gib:.2f} GiB" if graphs else "off (enforce_eager or not bf16): eager decode"),
    ]
    if kv_bytes <= 0:
        rows.append(("fits", f"NO: weights + KDA slots + graphs exceed the budget by {-kv_bytes / gib:.2f} GiB"))
        return rows
    tokens = kv_bytes // sizes.mla_bytes_per_token
    rows += [
        ("left for MLA KV", f"{kv_bytes / gib:.2f} GiB"),
        ("tokens of context that fit", f"{tokens:,}"),
        ("average context per running request", f"{tokens // max_num_seqs:,} tokens"),
    ]
    return rows
