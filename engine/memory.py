"""Per-rank memory accounting: weights, MLA latent KV per token, KDA state per request, the activations of
one eager prefill step, and with CUDA graphs the pad KDA slot and the graphs' memory.

The same numbers size the engine's pools and answer `k3serve plan`, so an operator can check
that a deployment of the published K3 fits before renting the hardware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from k3serve.engine.budget import DEFAULT_MAX_RUNNING_TO_SCALE, default_token_budget
from k3serve.engine.config import DEFAULT_CPU_BLOCK_BYTES, EngineArgs
from k3serve.engine.sampler import PROMPT_LOGPROBS_ROWS, sampling_workspace_bytes
from k3serve.engine.scheduler import SchedulerConfig
from k3serve.kernels.kda import chunk_kda_workspace_bytes
from k3serve.kernels.linear import CUBLAS_WORKSPACE_BYTES
from k3serve.kernels.mla import decode_workspace_bytes
from k3serve.kernels.moe import fused_experts_workspace_bytes
from k3serve.model.config import ModelConfig


@dataclass(frozen=True)
class CacheSizes:
    mla_bytes_per_token: int  # all MLA layers, replicated on every rank
    kda_bytes_per_slot: int  # all KDA layers, this rank's heads: recurrent fp32 + conv window
    weight_bytes: int | None  # this rank's weights as loaded (MXFP4 experts packed); None: not counted


def cache_sizes(config: ModelConfig, tp_size: int, dtype: torch.dtype, count_weights: bool = True) -> CacheSizes:
    """`count_weights` False: a plan in a fixed cache budget, which needs no weight count (it builds the model on the
    meta device, whose Python meta functions import torch._dynamo: ~150 MB in every CPU worker)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    h_local, d = config.kda.num_heads // tp_size, config.kda.head_dim
    recurrent = h_local * d * d * 4
    conv = 3 * h_local * d * (config.kda.conv_kernel_size - 1) * itemsize
    return CacheSizes(
        mla_bytes_per_token=len(config.mla_layers) * config.mla_kv_dim * itemsize,
        kda_bytes_per_slot=len(config.kda_layers) * (recurrent + conv),
        weight_bytes=weight_bytes(config, tp_size, dtype) if count_weights else None,
    )


def with_drafter(sizes: CacheSizes, args: EngineArgs) -> CacheSizes:
    """`sizes` plus what rank 0's model-based drafter holds (`engine/spec/drafter.py`): its cache (its MLA layers'
    rows a token of every block; a KDA slot's scratch blocks, and for a draft_model its KDA state twice: the kept
    one and the drafting copy), its weights, and for EAGLE / DSpark at TP > 1 full copies of the target's
    embedding and lm_head. Every rank is planned alike, so the followers leave that much unused."""
    spec = args.speculative_config
    if spec is None or spec.model is None:
        return sizes
    from k3serve.engine.spec.drafter import scratch_blocks
    from k3serve.model.draft.config import DrafterConfig
    from k3serve.model.draft.loader import DRAFTERS

    drafter = DrafterConfig.from_dir(spec.model_dir)
    own = cache_sizes(drafter.model, 1, args.torch_dtype, count_weights=False)
    itemsize = torch.empty((), dtype=args.torch_dtype).element_size()
    weights = None
    if sizes.weight_bytes is not None:
        if drafter.method == "draft_model":
            weights = sizes.weight_bytes + weight_bytes(drafter.model, 1, args.torch_dtype)
        else:
            with torch.device("meta"):
                module = DRAFTERS[drafter.method](drafter, args.torch_dtype)
                module.process_weights_after_loading()
            tp = args.tensor_parallel_size
            tables = 2 * drafter.model.vocab_size * drafter.model.hidden_size * itemsize if tp > 1 else 0
            weights = sizes.weight_bytes + sum(storage_bytes(held_tensors(module)).values()) + tables
    scratch = scratch_blocks(spec.num_speculative_tokens, args.block_size) * args.block_size
    return CacheSizes(
        mla_bytes_per_token=sizes.mla_bytes_per_token + own.mla_bytes_per_token,
        kda_bytes_per_slot=sizes.kda_bytes_per_slot + 2 * own.kda_bytes_per_slot + scratch * own.mla_bytes_per_token,
        weight_bytes=weights,
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
    block_size: int  # tokens a block id holds: the scheduler's block (`EngineArgs.tokens_per_block`)
    pad_slot: bool = False  # one more KDA slot in the cache, for CUDA-graph padding rows (no request owns it)
    graph_bytes: int = 0  # set aside for the captured decode graphs out of a device budget (`graph_reserve_bytes`)
    prefill_bytes: int = 0  # set aside for an eager step's activations (`prefill_activation_bytes`), likewise
    dcp_size: int = 1  # ranks a block's pages are spread over (decode context parallelism)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def page_size(self) -> int:
        """Tokens of a block one rank holds: its MLA tensors' block."""
        return self.block_size // self.dcp_size


def plan_pools(
    sizes: CacheSizes, cache_bytes: int, block_size: int, num_slots: int, max_model_len: int,
    pad_slot: bool = False, graph_bytes: int = 0, prefill_bytes: int = 0, num_blocks_override: int | None = None,
    dcp_size: int = 1,
) -> PoolPlan:
    """Give `num_slots` KDA slots (plus the pad slot), `graph_bytes` and `prefill_bytes` their bytes, the rest of
    `cache_bytes` to MLA blocks: all it holds, or `num_blocks_override` of them (`num_gpu_blocks_override`). A
    block holds `block_size` tokens, of which a rank stores 1 / `dcp_size`."""
    if block_size % dcp_size:
        raise ValueError(f"blocks of {block_size} tokens do not split into {dcp_size} decode context parallel pages")
    slot_bytes = (num_slots + pad_slot) * sizes.kda_bytes_per_slot
    block_bytes = block_size // dcp_size * sizes.mla_bytes_per_token
    num_blocks = (cache_bytes - slot_bytes - graph_bytes - prefill_bytes) // block_bytes if block_bytes else 0
    needed = math.ceil(max_model_len / block_size)
    if num_blocks_override is not None:
        if num_blocks_override > num_blocks:
            raise ValueError(f"num_gpu_blocks_override={num_blocks_override}: the cache budget of "
                             f"{cache_bytes / 2**20:.1f} MiB holds {max(num_blocks, 0)} blocks of {block_size} tokens")
        if num_blocks_override < needed:
            raise ValueError(f"num_gpu_blocks_override={num_blocks_override}: one request of max_model_len="
                             f"{max_model_len} needs {needed} blocks of {block_size} tokens")
        num_blocks = num_blocks_override
    if num_blocks < needed:
        graphs = f", {graph_bytes / 2**20:.1f} MiB for CUDA graphs" if graph_bytes else ""
        prefill = f", {prefill_bytes / 2**20:.1f} MiB for a prefill step's activations" if prefill_bytes else ""
        raise ValueError(
            f"a cache budget of {cache_bytes / 2**20:.1f} MiB holds {max(num_blocks, 0)} blocks of {block_size} tokens "
            f"after {num_slots + pad_slot} KDA slots ({slot_bytes / 2**20:.1f} MiB){graphs}{prefill}; one request of "
            f"max_model_len={max_model_len} needs {needed} blocks. Raise the cache budget or lower max_model_len / "
            "max_num_seqs" + (" / max_num_batched_tokens" if prefill_bytes else "") + "."
        )
    return PoolPlan(num_blocks=int(num_blocks), num_slots=num_slots, block_size=block_size, pad_slot=pad_slot,
                    graph_bytes=graph_bytes, prefill_bytes=prefill_bytes, dcp_size=dcp_size)


def plan_engine_pools(config: ModelConfig, args: EngineArgs, usable_bytes: int | None = None,
                      device_bytes: int | None = None) -> PoolPlan:
    """The pools of an engine run with `args`: in `cache_memory_bytes` when given (MLA blocks and KDA slots);
    else in `usable_bytes` (on CUDA: what `gpu_memory_utilization` leaves of the free memory) less this
    engine's weights (planned before they load), the captured graphs' memory and one eager step's activations
    (`prefill_activation_bytes`; `device_bytes`, the device's total memory, sets the default token budget);
    else the CPU default (the KDA slots and `DEFAULT_CPU_BLOCK_BYTES` of MLA blocks).
    With CUDA graphs (`graphs_allowed(args)`: not under `enforce_eager`, ...) the cache holds the pad slot
    too; at TP > 1 only where NCCL is asked for (the default; `K3SERVE_TP_NCCL=0` opts out: gloo's collectives
    cannot be recorded). The plan is made before the ranks join: should NCCL be refused there (ranks sharing a
    GPU, a torch without NCCL, another rank opted out: `engine/tp_group.py`), what was set aside for them stays
    unused. NCCL's own buffers, not counted here,
    come out of what `gpu_memory_utilization` leaves free (they are made after the plan)."""
    from k3serve.engine.cuda_graphs import graphs_allowed

    sizes = with_drafter(cache_sizes(config, args.tensor_parallel_size, args.torch_dtype,
                                     count_weights=args.cache_memory_bytes is None and usable_bytes is not None), args)
    graphs = graphs_allowed(args)
    graph_bytes = prefill_bytes = 0
    if args.cache_memory_bytes is not None:
        cache_bytes = args.cache_memory_bytes
    elif usable_bytes is not None:
        if usable_bytes <= sizes.weight_bytes:
            raise ValueError(
                f"this rank's weights ({sizes.weight_bytes / 2**30:.2f} GiB) do not fit in the usable device memory "
                f"({usable_bytes / 2**30:.2f} GiB: the free memory less 1 - gpu_memory_utilization="
                f"{1 - args.gpu_memory_utilization:.2f} of the device). Raise gpu_memory_utilization or "
                "tensor_parallel_size, or free the device."
            )
        graph_bytes = graph_reserve_bytes(config, args) if graphs else 0
        prefill_bytes = prefill_activation_bytes(config, args, device_bytes)
        cache_bytes = usable_bytes - sizes.weight_bytes
    else:  # the KDA slots (a model's slot can be large) and DEFAULT_CPU_BLOCK_BYTES of MLA blocks
        cache_bytes = (args.kda_slots + graphs) * sizes.kda_bytes_per_slot + DEFAULT_CPU_BLOCK_BYTES
    return plan_pools(sizes, cache_bytes, args.tokens_per_block, args.kda_slots, args.max_model_len, pad_slot=graphs,
                      graph_bytes=graph_bytes, prefill_bytes=prefill_bytes,
                      num_blocks_override=args.num_gpu_blocks_override, dcp_size=args.decode_context_parallel_size)


PLAN_NUM_SM = 148
"""SMs of the largest GPU the plan is made for (a B200; an H200 has 132): the MLA decode's split-K partials grow
with them (`kernels/mla` `decode_workspace_bytes`), and the offline `k3serve plan` sees no device."""
ALLOCATOR_ROUNDING_BYTES = 22 * 2**20
"""The caching allocator's rounding in a graph pool: a 2 MiB segment for small blocks, 20 MiB for mid-sized ones."""
SMALL_STEP_BUFFERS_BYTES = 8 * 2**20
"""An eager step's buffers that do not grow with its tokens: the KDA chunk plan, SDPA's row statistics, the MoE
routing's counts."""


def mla_decode_workspace_bytes(config: ModelConfig, tp_size: int, dcp_size: int = 1) -> int:
    """The MLA decode's split-K partials for the heads a rank attends for (0 without MLA layers): its own, or with
    decode context parallelism its DCP group's; one layer's at a time."""
    if not config.mla_layers:
        return 0
    return decode_workspace_bytes(config.num_attention_heads // tp_size * dcp_size, config.kv_lora_rank, PLAN_NUM_SM)


def graph_pool_slack_bytes(config: ModelConfig, tp_size: int, dcp_size: int = 1) -> int:
    """What a graph pool holds that does not grow with the rows: the MLA decode's split-K partials, cuBLAS's
    workspace for the capture stream and the caching allocator's rounding."""
    return mla_decode_workspace_bytes(config, tp_size, dcp_size) + CUBLAS_WORKSPACE_BYTES + ALLOCATOR_ROUNDING_BYTES


def prefill_fixed_bytes(config: ModelConfig, tp_size: int, dcp_size: int = 1) -> int:
    """What an eager step holds beside its activations, made after the plan: cuBLAS's and cuBLASLt's workspaces for
    the default stream (kept from the first GEMM on), a mixed step's absorbed-decode split-K partials and the small
    buffers that do not grow with the tokens."""
    return 2 * CUBLAS_WORKSPACE_BYTES + mla_decode_workspace_bytes(config, tp_size, dcp_size) + SMALL_STEP_BUFFERS_BYTES


def graph_reserve_bytes(config: ModelConfig, args: EngineArgs) -> int:
    """Device memory of the captured decode graphs: their fixed-address inputs and output (exact) and an
    estimate of their private memory pool.

    The pool holds what the recorded step allocates. Blocks freed during a capture are reused later in the
    same capture, and every bucket records into one pool (only one replays at a time), so the largest
    bucket's activation workspace sizes it: `decode_activation_bytes` per row (generous: everything a layer
    makes counted live at once) times the rows, plus `graph_pool_slack_bytes` for what does not grow with
    the rows. vLLM measures its graphs' pool instead, by capturing before it sizes the KV cache;
    capture here needs the cache, so the plan estimates, and `benchmarks/gpu_memory_plan.py` reports the
    estimate beside what a capture really holds. At TP > 1 the rows are this rank's
    shard's (`args.tensor_parallel_size`); the recorded all-reduces work in place, taking nothing from the
    pool (NCCL keeps a small work buffer of its own per recorded collective, outside it)."""
    from k3serve.model.batch import StaticDecodeInputs

    rows = args.graph_batch_sizes[-1]
    itemsize = torch.empty((), dtype=args.torch_dtype).element_size()
    inputs = StaticDecodeInputs(rows, math.ceil(args.max_model_len / args.tokens_per_block), args.tokens_per_block, 0,
                                "meta")
    output = rows * config.hidden_size * itemsize
    dcp = args.decode_context_parallel_size
    activations = rows * decode_activation_bytes(config, args.tensor_parallel_size, args.torch_dtype, dcp)
    return inputs.device_bytes + output + activations + graph_pool_slack_bytes(config, args.tensor_parallel_size, dcp)


def decode_activation_bytes(config: ModelConfig, tp_size: int, dtype: torch.dtype, dcp_size: int = 1) -> int:
    """Bytes one decode row's step allocates, counted generously: the residual stream (the attention-residual
    bank) held through the step, plus everything the widest layer part makes counted live at once, fp32
    where the layer computes in fp32. With decode context parallelism the MLA layer also holds its DCP group's
    gathered queries and the fp32 partial outputs it sends and receives (`model/layers/mla_dcp.py`)."""
    b = torch.empty((), dtype=dtype).element_size()
    hidden = config.hidden_size
    stream = (residual_rows(config) + 3) * hidden * b  # the bank, a layer's input, its mixer's and its MLP's outputs
    p = config.kda.num_heads // tp_size * config.kda.head_dim
    kda = p * (10 * b + 4) + hidden * b  # projections, conv, q/k/v, gate (fp32), outputs, o_proj
    h, latent = config.num_attention_heads // tp_size, config.kv_lora_rank
    q_width = h * config.qk_head_dim
    mla = ((config.q_lora_rank or 0) + 2 * q_width + 2 * config.mla_kv_dim + h * config.v_head_dim) * b \
        + h * latent * (4 + b) + 2 * h * config.v_head_dim * 4 + hidden * b  # q, latent, absorbed q, o, gate
    if dcp_size > 1:  # q [H, L+R] and the group's [W, H, L+R], q_all; partials [W*H, L+1] out, packed, in
        mla += h * config.mla_kv_dim * 4 * (1 + 2 * dcp_size) + 3 * dcp_size * h * (latent + 1) * 4
    dense = 3 * config.intermediate_size // tp_size * b + hidden * b
    moe = 0
    if config.num_experts:
        width = config.routed_expert_hidden_size or hidden
        shared = config.shared_intermediate // tp_size
        top_k = config.num_experts_per_token
        moe = (config.num_experts * 4 + top_k * 16  # router logits fp32, top-k weights and ids
               + width * (2 * b + 4) + top_k * config.moe_intermediate_size * b  # expert input, h, fp32 sum, norm
               + 3 * shared * b + hidden * (2 * b + 4))  # shared experts, up-projection, fp32 shared sum
    return stream + max(kda, mla, dense, moe)


def residual_rows(config: ModelConfig) -> int:
    """Rows of the residual stream a forward holds per token: the attention-residual bank (a snapshot a block
    and the running prefix, `KimiModel.forward`'s `sources`), or the plain residual."""
    if not config.attn_res_block_size:
        return 1
    return -(-config.num_hidden_layers // config.attn_res_block_size) + 1


def base_token_budget(args: EngineArgs, device_bytes: int | None) -> int:
    """The scheduler's base token budget (`engine/budget.py`) for an engine run with `args` on a device of
    `device_bytes` (None: no GPU): `max_num_batched_tokens`, else the device's default, and at least
    `max_num_seqs` (every running decode fits one step)."""
    return max(args.max_num_batched_tokens or default_token_budget(device_bytes), args.max_num_seqs)


def scheduler_config(args: EngineArgs, device_bytes: int | None, eos_token_id: int | None) -> SchedulerConfig:
    """The scheduler's config of an engine run with `args` on a device of `device_bytes` (None: no GPU): the one
    place it is made, every default resolved here (the base budget by `base_token_budget`, the adaptive ceiling
    twice it, or the base itself under `adaptive_token_budget=False`: a static budget)."""
    base = base_token_budget(args, device_bytes)
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=base,
        max_adaptive_batched_tokens=(args.max_adaptive_batched_tokens or 2 * base) if args.adaptive_token_budget else base,
        max_model_len=args.max_model_len,
        block_size=args.tokens_per_block, enable_prefix_caching=args.enable_prefix_caching,
        kda_checkpoint_mode=args.kda_checkpoint_mode, eos_token_id=eos_token_id,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_running_to_scale=DEFAULT_MAX_RUNNING_TO_SCALE,
    )


def max_step_tokens(args: EngineArgs, device_bytes: int | None) -> int:
    """The most tokens one forward pass runs: the adaptive budget's ceiling (`scheduler_config`)."""
    return scheduler_config(args, device_bytes, None).max_adaptive_batched_tokens


@dataclass(frozen=True)
class StepShape:
    """The largest eager step of an engine, as the prefill estimate sizes it."""

    num_tokens: int  # `max_step_tokens`: new tokens of all its sequences
    num_seqs: int  # its sequences and sampled rows: at most max_num_seqs, at most one a token
    max_seq_len: int  # max_model_len: one sequence's context, its new tokens included
    tp_size: int
    itemsize: int  # bytes of an element of the model's dtype
    dcp_size: int = 1  # decode context parallel ranks: the MLA prefill gathers the context's pages from them

    @property
    def max_chunk(self) -> int:
        """New tokens of one sequence."""
        return min(self.num_tokens, self.max_seq_len)

    @property
    def mla_keys(self) -> int:
        """Keys the MLA prefill holds at once: the step's new tokens and one longest cached prefix (its groups, see
        `prefill_activation_bytes`)."""
        return self.num_tokens + self.max_seq_len


def prefill_activation_bytes(config: ModelConfig, args: EngineArgs, device_bytes: int | None = None) -> int:
    """Device memory one eager step of `max_step_tokens(args, device_bytes)` tokens allocates beyond the weights
    and pools, at its peak, on the GPU kernels' paths (bf16/fp16, fla installed): an upper bound built from the
    model's shapes and what each op allocates, held against a measurement by tests/engine/test_prefill_memory_gpu.py.

        peak = max(forward, logits, prompt, sampling) + `prefill_fixed_bytes`
        forward  = held across layers: the residual bank (`residual_rows`), the previous layer's output still to
                   add, the attention output beside the MLP, the batch's int64 token rows
                   + the largest peak of one layer part, its input and output included (`_kda_prefill_bytes`,
                   `_mla_prefill_bytes`, `_moe_prefill_bytes`, `_dense_mlp_bytes`): each the max over that
                   part's phases, a kernel's own scratch as its package estimates it (`kernels/kda`
                   `chunk_kda_workspace_bytes`, `kernels/moe` `fused_experts_workspace_bytes`, both with the
                   autotuner's flush buffer)
        logits   = the final hidden states, the sampled rows (one a sequence) and their logits
        prompt   = the final hidden states and the sampled logits, still held, + one slice of prompt logprobs
                   (`prompt_logprobs_slice_bytes`: the runner scores prompt rows `PROMPT_LOGPROBS_ROWS` at a time,
                   however long the chunk and however many of the step's requests ask)
        sampling = the sampler's copies of those logits (`engine/sampler.py` `sampling_workspace_bytes`)
    With `speculative_config` the sampled rows are up to 1 + K a request and the forward also holds the verify
    records of them (`verify_records_bytes`).

    Every token of a mixed step counts at prefill rates, its decodes included. The MLA prefill gathers and
    up-projects the cached context of consecutive groups of prefill sequences one group at a time, each group's
    cached prefixes summing to at most the step's longest one (`MLAAttention._prefill`), so the keys held at once
    are within the step's new tokens plus one longest cached prefix (`StepShape.mla_keys`), however many
    prefix-cache hits the step admitted. Ignores: fp32 on CUDA and CUDA without fla (the reference ops: e.g. the MLA scores [H, q, k] in fp32), the
    caching allocator's fragmentation (reserved less allocated, left to 1 - gpu_memory_utilization) and NCCL's
    buffers."""
    phases = prefill_phase_bytes(config, args, device_bytes)
    return max(phases.values()) + prefill_fixed_bytes(config, args.tensor_parallel_size,
                                                      args.decode_context_parallel_size)


def prefill_phase_bytes(config: ModelConfig, args: EngineArgs, device_bytes: int | None = None) -> dict[str, int]:
    """The terms of `prefill_activation_bytes`, before its fixed bytes: for each layer part the model has ("kda",
    "mla", "moe", "dense_mlp") what the forward holds across layers plus that part's peak, and the step's
    "logits", "prompt_logprobs" and "sampling"."""
    num_tokens = max_step_tokens(args, device_bytes)
    step = StepShape(num_tokens, min(args.max_num_seqs, num_tokens), args.max_model_len, args.tensor_parallel_size,
                     torch.empty((), dtype=args.torch_dtype).element_size(), args.decode_context_parallel_size)
    hidden, b, tp = config.hidden_size, step.itemsize, step.tp_size
    moe_layers = [config.is_moe_layer(i) for i in range(config.num_hidden_layers)]  # as `DecoderLayer` builds them
    parts = {"kda": _kda_prefill_bytes(config, step)} if config.kda_layers else {}
    parts |= {"mla": _mla_prefill_bytes(config, step)} if config.mla_layers else {}
    unfused = _unfused_finalize_bytes(config, step) if args.moe_finalize == "unfused" else 0
    parts |= {"moe": _moe_prefill_bytes(config, step) + unfused} if any(moe_layers) else {}
    parts |= {"dense_mlp": _dense_mlp_bytes(config, step)} if not all(moe_layers) else {}
    held = num_tokens * ((residual_rows(config) + 2) * hidden * b + 3 * 8)  # + token ids, positions, slot mapping
    rows, vocab = step.num_seqs, config.vocab_size
    spec = args.speculative_config
    if spec is not None:  # verify rows: 1 + K logits rows a request, their records held until the commit
        rows = min(num_tokens, args.max_num_seqs * (1 + spec.num_speculative_tokens))
        held += verify_records_bytes(config, tp, rows, b)
    shard = -(-vocab // tp)  # this rank's lm_head rows; rank 0 gathers every rank's, then widens them to fp32
    return {
        **{name: held + part for name, part in parts.items()},
        "logits": num_tokens * hidden * b + rows * (hidden * b + shard * b * (1 + tp * (tp > 1)) + vocab * 4),
        "prompt_logprobs": num_tokens * hidden * b + rows * tp * shard * 4 + prompt_logprobs_slice_bytes(config, tp, b),
        "sampling": sampling_workspace_bytes(rows, vocab),
    }


def verify_records_bytes(config: ModelConfig, tp_size: int, num_rows: int, itemsize: int) -> int:
    """What a speculative step's verify pass keeps for the commit (`model/batch.py` `VerifyRecords`), every KDA layer's
    at once: per row and layer the fp32 key, update and log decay of this rank's heads and the pre-conv q, k, v
    inputs in the model's dtype."""
    h_local, d = config.kda.num_heads // tp_size, config.kda.head_dim
    return num_rows * len(config.kda_layers) * h_local * d * (3 * 4 + 3 * itemsize)


def prompt_logprobs_slice_bytes(config: ModelConfig, tp_size: int, itemsize: int) -> int:
    """Peak bytes one slice of `PROMPT_LOGPROBS_ROWS` prompt rows allocates on rank 0
    (`ModelRunner.score_prompt`), the larger of
      lm_head  this rank's logits [rows, shard] in the model's dtype, at TP > 1 every rank's gathered into one
               [tp, rows, shard] buffer, and their fp32 widening [rows, tp * shard] (padding included);
      softmax  that fp32 widening and two fp32 [rows, vocab]: log_softmax's contiguous copy of it (a view where
               padding is cut off) and its output; later the output and the rank count's bool mask and its int64
               copy, `RANK_ROWS` rows at a time (`gather_logprobs`), smaller."""
    rows, vocab = PROMPT_LOGPROBS_ROWS, config.vocab_size
    shard = -(-vocab // tp_size)
    lm_head = rows * shard * (itemsize * (1 + tp_size * (tp_size > 1)) + tp_size * 4)
    softmax = rows * (tp_size * shard * 4 + 2 * vocab * 4)
    return max(lm_head, softmax)


def _kda_prefill_bytes(config: ModelConfig, step: StepShape) -> int:
    """Peak of a KDA layer's prefill (`KimiDeltaAttention.forward`): its input and the stacked projections'
    output [T, 3P + d + H + gate], plus the largest of
      conv    the short conv (`kernels/conv/triton_prefill.py`, one launch): its output, in the model's dtype;
      chunk   the conv's output, the fp32 gate and beta, the sequences' fp32 states (initial, final, checkpoint),
              and fla's chunk_kda inside (`kernels/kda` `chunk_kda_workspace_bytes`);
      output  the conv's output, the gate, the chunk's output, the gated norm and o_proj."""
    kda, T, b = config.kda, step.num_tokens, step.itemsize
    H, d = kda.num_heads // step.tp_size, kda.head_dim
    P = H * d
    C = 3 * P  # the conv's channels: q, k, v
    gate = P if kda.use_full_rank_gate else d
    held = T * (config.hidden_size + C + d + H + gate) * b
    conv = C * T * b
    states = 3 * step.num_seqs * H * d * d * 4
    fla = chunk_kda_workspace_bytes(T, step.num_seqs, H, d, b)
    chunk = T * (C * b + 4 * P + 4 * H) + states + fla
    output = T * (C * b + 4 * P + 2 * P * b + config.hidden_size * b)
    return held + max(conv, chunk, output)


def _mla_prefill_bytes(config: ModelConfig, step: StepShape) -> int:
    """Peak of an MLA layer's prefill (`MLAAttention.forward`, `_prefill`): its input, the stacked projections'
    output and q (q_b's output; q_a_layernorm's too while q_b runs), plus the larger of
      keys    for `step.mla_keys` keys: the gathered cache rows (and their int64 indices), the latent's copy for
              kv_b_proj, its k_nope|v output and the concatenated keys; the output rows; and either one
              sequence's SDPA (v padded to the q/k head size, copies of q, k and v where SDPA wants them, its
              output and statistics) or the output's fp32 copy;
      output  the fp32 output (twice where decode rows are concatenated), gated into the model's dtype, o_proj."""
    T, L, b = step.num_tokens, step.max_chunk, step.itemsize
    H = config.num_attention_heads // step.tp_size
    q_width, v_width = H * config.qk_head_dim, H * config.v_head_dim
    q_lora = config.q_lora_rank or 0
    gate = v_width if config.mla_use_output_gate else 0
    held = T * (config.hidden_size + (q_lora or q_width) + config.mla_kv_dim + gate) * b
    q = T * (q_width + q_lora) * b if q_lora else 0
    per_key = (config.mla_kv_dim + config.kv_lora_rank + H * (config.qk_nope_head_dim + config.v_head_dim)
               + q_width) * b + 4 * 8
    if step.dcp_size > 1:  # the group's pages all-gathered (and this rank's copy), then put in order
        per_key += config.mla_kv_dim * b + -(-config.mla_kv_dim * b // step.dcp_size) + 8
    sdpa = (3 * step.max_seq_len + 2 * L) * q_width * b + H * L * 4
    keys = step.mla_keys * per_key + T * v_width * b + max(sdpa, T * v_width * 4)
    output = T * (v_width * (2 * 4 + b) + config.hidden_size * b)
    return held + q + max(keys, output)


def _moe_prefill_bytes(config: ModelConfig, step: StepShape) -> int:
    """Peak of a MoE layer (`SparseMoE.forward`, MXFP4 experts on `kernels/moe/triton_moe.py`): its input, plus
    the largest of
      router  the fp32 logits [T, E] and the top-k picks (fp32 weights, int64 ids);
      experts the picks, the stacked projections' output (latent down-projection, shared gate|up) and the
              Triton experts' scratch (`kernels/moe` `fused_experts_workspace_bytes`);
      output  the picks and projections, the fp32 routed sum and its norm, the shared experts' fp32 sums, the
              fp32 up-projection, their fp32 sum and its rounding."""
    T, b, hidden = step.num_tokens, step.itemsize, config.hidden_size
    top_k, inter = config.num_experts_per_token, config.moe_intermediate_size
    width = config.routed_expert_hidden_size or hidden
    shared = config.shared_intermediate // step.tp_size
    picks = T * top_k * (4 + 8)
    projected = T * ((width if config.routed_expert_hidden_size else 0) + 2 * shared) * b
    router = T * config.num_experts * 4 + picks
    experts = picks + projected + fused_experts_workspace_bytes(T, top_k, width, inter, b)
    output = picks + projected + T * (width * (4 + b) + shared * b + hidden * (12 + b))
    return T * hidden * b + max(router, experts, output)


def _unfused_finalize_bytes(config: ModelConfig, step: StepShape) -> int:
    """What `moe_finalize="unfused"` adds to a MoE layer (`kernels.moe._unfused_experts`): x a pair [T * top_k,
    width] in the model's dtype, the pairs' fp32 outputs and their weighted fp32 product before the sum."""
    pairs = step.num_tokens * config.num_experts_per_token
    return pairs * (config.routed_expert_hidden_size or config.hidden_size) * (step.itemsize + 8)


def _dense_mlp_bytes(config: ModelConfig, step: StepShape) -> int:
    """A dense MLP layer (`DenseMLP`): its input, gate|up, the activation and the output."""
    inter = config.intermediate_size // step.tp_size
    return step.num_tokens * (2 * config.hidden_size + 3 * inter) * step.itemsize


def describe_plan(config: ModelConfig, args: EngineArgs, device_bytes: int) -> list[tuple[str, str]]:
    """Rows of `k3serve plan`: what one rank of an engine run with `args` holds and how much context fits
    beside the weights (the engine's KDA slots, `args.kda_slots`: one per running request, and with prefix
    caching as many for its checkpoints; the pad slot and the graphs' memory when `args` allow CUDA graphs;
    one eager step's activations). With decode context parallelism a rank holds 1 / N of each token's latent KV,
    and the context that fits is set against the same engine without it."""
    dcp = args.decode_context_parallel_size
    rows = _plan_rows(config, args, device_bytes)
    if dcp == 1 or rows[-1][0] == "fits":
        return rows
    without = _plan_rows(config, replace(args, decode_context_parallel_size=1), device_bytes)
    if without[-1][0] == "fits":
        return rows + [("without decode context parallelism", "does not fit")]
    tokens, base = (int(dict(r)["tokens of context that fit"].replace(",", "")) for r in (rows, without))
    return rows + [("tokens of context that fit without DCP (latent KV on every rank)", f"{base:,}"),
                   (f"DCP {dcp} capacity gain", f"{tokens / base:.2f}x")]


def _plan_rows(config: ModelConfig, args: EngineArgs, device_bytes: int) -> list[tuple[str, str]]:
    """`describe_plan`'s rows of one engine."""
    from k3serve.engine.cuda_graphs import graphs_off_reason

    tp_size, utilization, max_num_seqs = args.tensor_parallel_size, args.gpu_memory_utilization, args.max_num_seqs
    dcp = args.decode_context_parallel_size
    config.check_tp(tp_size)
    sizes = cache_sizes(config, tp_size, args.torch_dtype)
    budget = int(device_bytes * utilization) - sizes.weight_bytes
    off_reason = graphs_off_reason(args)
    graphs = off_reason is None
    graph_bytes = graph_reserve_bytes(config, args) if graphs else 0
    prefill_bytes = prefill_activation_bytes(config, args, device_bytes)
    slots = args.kda_slots + graphs
    slots_bytes = slots * sizes.kda_bytes_per_slot
    kv_bytes = budget - slots_bytes - graph_bytes - prefill_bytes
    gib = 2**30
    rows = [
        ("tensor-parallel ranks", str(tp_size)),
        *([("decode context parallel ranks (a DCP group)", f"{dcp}: each holds 1/{dcp} of every request's MLA KV")]
          if dcp > 1 else []),
        ("device memory x utilization", f"{device_bytes / gib:.1f} GiB x {utilization:.2f}"),
        ("weights per rank (MXFP4 experts packed)", f"{sizes.weight_bytes / gib:.2f} GiB"),
        ("MLA latent KV per token (all MLA layers)", f"{sizes.mla_bytes_per_token / 1024:.1f} KiB"
         + (f", {sizes.mla_bytes_per_token / dcp / 1024:.2f} KiB on a rank" if dcp > 1 else "")),
        ("KDA state per request (this rank's heads)", f"{sizes.kda_bytes_per_slot / 2**20:.1f} MiB"),
        (f"KDA slots for max_num_seqs={max_num_seqs}"
         + (" and prefix-cache checkpoints" if args.kda_slots > max_num_seqs else "")
         + (" + the CUDA-graph pad slot" if graphs else ""),
         f"{slots} slots, {slots_bytes / gib:.2f} GiB"),
        ("CUDA graphs (decode, up to batch "
         f"{args.graph_batch_sizes[-1]}: inputs, output, pool estimate)" if graphs else "CUDA graphs",
         f"{graph_bytes / gib:.2f} GiB" if graphs else f"off ({off_reason}): eager decode"),
        (f"prefill activations (an eager step of {max_step_tokens(args, device_bytes):,} tokens, estimate)",
         f"{prefill_bytes / gib:.2f} GiB"),
    ]
    if kv_bytes <= 0:
        rows.append(("fits", f"NO: weights + KDA slots + graphs + prefill activations exceed the budget by "
                             f"{-kv_bytes / gib:.2f} GiB"))
        return rows
    tokens = kv_bytes * dcp // sizes.mla_bytes_per_token
    rows += [
        ("left for MLA KV", f"{kv_bytes / gib:.2f} GiB"),
        ("tokens of context that fit", f"{tokens:,}"),
        ("average context per running request", f"{tokens // max_num_seqs:,} tokens"),
    ]
    return rows
