"""The memory plan counts exactly the weight bytes a loaded engine holds: the loaded tensors and what is
derived from them at load time (fp32 router and MLA absorption weights in a bf16 model), each storage once;
out of a device budget it sets aside one eager prefill step's activations (for the largest step the engine's
scheduler runs); and, where the engine captures CUDA graphs, the pad KDA slot and the graphs' memory.
(That the prefill estimate bounds a real step: test_prefill_memory_gpu.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from k3serve.engine.config import EngineArgs
from k3serve.engine.cuda_graphs import graphs_enabled
from k3serve.engine.llm import LLM
from k3serve.engine.memory import (PoolPlan, cache_sizes, decode_activation_bytes, describe_plan,
                                   graph_pool_slack_bytes, graph_reserve_bytes, max_step_tokens, plan_engine_pools,
                                   plan_pools, prefill_activation_bytes, prefill_fixed_bytes,
                                   prompt_logprobs_slice_bytes, weight_bytes)
from k3serve.engine.tp_group import NCCL_SWITCH
from k3serve.model.batch import ModelCache, StaticDecodeInputs
from k3serve.model.config import ModelConfig
from k3serve.model.loader import load_model
from k3serve.model.presets import preset_config


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct storage a real model's modules reference."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for m in model.modules() for v in vars(m).values()
                for t in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(t, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planned_weight_bytes_equal_what_a_loaded_model_holds(tiny_checkpoint: Path, dtype: torch.dtype) -> None:
    config = ModelConfig.from_dir(tiny_checkpoint)
    assert weight_bytes(config, 1, dtype) == _held_bytes(load_model(tiny_checkpoint, dtype=dtype))


def test_bf16_plan_includes_the_fp32_copies_derived_at_load(tiny_checkpoint: Path) -> None:
    config = ModelConfig.from_dir(tiny_checkpoint)
    model = load_model(tiny_checkpoint, dtype=torch.bfloat16)
    loaded = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert weight_bytes(config, 1, torch.bfloat16) > loaded
    scores = model.model.layers[0].attn_res_scores  # derived too, kept as a tuple of tensors
    assert scores and weight_bytes(config, 1, torch.bfloat16) - loaded >= sum(t.nbytes for t in scores)


GRAPHS = dict(device="cuda", block_size=8, max_model_len=64, max_num_seqs=4, num_kda_slots=6)


def _cache_bytes(cache: ModelCache) -> int:
    return sum(t.nbytes for t in cache.mla_kv + cache.kda_recurrent + cache.kda_conv)


def _allocate(config: ModelConfig, plan: PoolPlan) -> ModelCache:
    return ModelCache.allocate(config, plan.num_blocks, plan.num_slots, plan.block_size, 1, torch.bfloat16,
                               reserve_pad_slot=plan.pad_slot)


def test_the_cache_holds_the_pad_slot_only_when_graphs_are_captured() -> None:
    """`cache_memory_bytes` = exactly what the eager engine's pools take: the eager plan fills it to the byte;
    with graphs on, the cache `ModelCache.allocate` really makes, pad slot included, still fits with less
    than one block left over (a pad slot the plan forgot would overflow: a slot outweighs a block)."""
    config = preset_config("k3-tiny")
    sizes = cache_sizes(config, 1, torch.bfloat16)
    block_bytes = GRAPHS["block_size"] * sizes.mla_bytes_per_token
    assert sizes.kda_bytes_per_slot > block_bytes
    budget = 6 * sizes.kda_bytes_per_slot + 100 * block_bytes
    eager_args = EngineArgs(**GRAPHS, cache_memory_bytes=budget, enforce_eager=True)
    graph_args = EngineArgs(**GRAPHS, cache_memory_bytes=budget)
    assert graphs_enabled(graph_args) and not graphs_enabled(eager_args)

    eager, graphs = plan_engine_pools(config, eager_args), plan_engine_pools(config, graph_args)
    assert eager == PoolPlan(num_blocks=100, num_slots=6, block_size=8)
    assert graphs.pad_slot and graphs.num_slots == 6 and graphs.graph_bytes == 0  # not out of a cache budget
    assert _cache_bytes(_allocate(config, eager)) == budget
    cache = _allocate(config, graphs)
    assert cache.pad_slot == 6 and 0 <= budget - _cache_bytes(cache) < block_bytes


def _device_budget(config: ModelConfig, args: EngineArgs, num_blocks: int, prefill: bool = True) -> int:
    """Usable bytes in which the plan of `args` (graphs on) finds exactly `num_blocks` blocks; without the room
    for the prefill step's activations when `prefill` is False."""
    sizes = cache_sizes(config, 1, torch.bfloat16)
    return (sizes.weight_bytes + graph_reserve_bytes(config, args) + (args.kda_slots + 1) * sizes.kda_bytes_per_slot
            + num_blocks * args.block_size * sizes.mla_bytes_per_token
            + (prefill_activation_bytes(config, args) if prefill else 0))


def test_a_device_budget_loses_the_weights_the_graphs_and_a_prefill_step_first() -> None:
    config = preset_config("k3-tiny")
    args = EngineArgs(**GRAPHS)
    sizes = cache_sizes(config, 1, torch.bfloat16)
    reserve, prefill = graph_reserve_bytes(config, args), prefill_activation_bytes(config, args)
    assert reserve > graph_pool_slack_bytes(config, 1) and prefill > 0
    usable = _device_budget(config, args, 100)
    plan = plan_engine_pools(config, args, usable)
    assert plan == PoolPlan(num_blocks=100, num_slots=6, block_size=8, pad_slot=True, graph_bytes=reserve,
                            prefill_bytes=prefill)
    assert sizes.weight_bytes + reserve + prefill + _cache_bytes(_allocate(config, plan)) == usable
    eager = plan_engine_pools(config, EngineArgs(**GRAPHS, enforce_eager=True), usable)
    assert eager.graph_bytes == 0 and not eager.pad_slot and eager.num_blocks > plan.num_blocks
    assert eager.prefill_bytes == prefill  # an eager engine prefills alike


def test_the_prefill_reserve_shrinks_the_pools_by_exactly_its_bytes() -> None:
    config = preset_config("k3-tiny")
    args = EngineArgs(**GRAPHS)
    sizes = cache_sizes(config, 1, torch.bfloat16)
    cache_bytes = _device_budget(config, args, 100) - sizes.weight_bytes
    kw = dict(block_size=8, num_slots=6, max_model_len=64, pad_slot=True, graph_bytes=graph_reserve_bytes(config, args))
    prefill = prefill_activation_bytes(config, args)
    without, with_it = plan_pools(sizes, cache_bytes, **kw), plan_pools(sizes, cache_bytes, **kw, prefill_bytes=prefill)
    assert with_it.num_blocks == 100 and with_it.num_slots == without.num_slots
    assert without.num_blocks == 100 + prefill // (8 * sizes.mla_bytes_per_token)


def test_too_small_a_device_budget_names_the_prefill_reserve_not_a_negative_pool() -> None:
    config = preset_config("k3-tiny")
    args = EngineArgs(**GRAPHS)
    with pytest.raises(ValueError, match=r"holds 0 blocks .* MiB for a prefill step's activations; one request of "
                                         r"max_model_len=64 needs 8 blocks.* max_num_batched_tokens"):
        plan_engine_pools(config, args, _device_budget(config, args, 100, prefill=False))
    with pytest.raises(ValueError, match=r"weights \(.* GiB\) do not fit in the usable device memory"):
        plan_engine_pools(config, args, cache_sizes(config, 1, torch.bfloat16).weight_bytes)


STEP = dict(device="cuda", max_model_len=8192, max_num_seqs=4)


def test_the_prefill_reserve_sizes_the_largest_step_the_scheduler_runs() -> None:
    """The adaptive budget's ceiling (twice the base by default), not the base: a base of 2048 plans as a static
    budget of 4096. Without max_num_batched_tokens the device's default base counts (16384 from 80 GiB)."""
    config = preset_config("k3-tiny")

    def bound(**kw) -> int:
        return prefill_activation_bytes(config, EngineArgs(**STEP, **kw), 141 * 2**30)

    assert bound(max_num_batched_tokens=2048) == bound(max_num_batched_tokens=4096, max_adaptive_batched_tokens=4096)
    assert bound(max_num_batched_tokens=2048, max_adaptive_batched_tokens=2048) < bound(max_num_batched_tokens=2048)
    assert bound() == bound(max_num_batched_tokens=16384)
    assert prefill_activation_bytes(config, EngineArgs(**STEP), 40 * 2**30) == bound(max_num_batched_tokens=8192)


def test_the_prefill_reserve_holds_a_prompt_logprobs_slice_not_a_chunks_logits() -> None:
    """Prompt logprobs are scored `PROMPT_LOGPROBS_ROWS` rows at a time: at K3 TP8 a slice takes under 0.5 GiB
    however long the chunk, and a 32K step's reserve holds it beside the step's hidden states, where that chunk's
    whole fp32 logits (21 GB) alone would not fit in the reserve. Where the slice is a step's largest allocation (a small
    step at K3's vocab), the reserve is sized by it."""
    k3 = preset_config("kimi-k3")
    step = dict(device="cuda", max_model_len=32768, tensor_parallel_size=8, max_num_seqs=64,
                max_num_batched_tokens=32768, max_adaptive_batched_tokens=32768)
    reserve = prefill_activation_bytes(k3, EngineArgs(**step))
    assert prompt_logprobs_slice_bytes(k3, 8, 2) < 2**29
    assert 32768 * k3.hidden_size * 2 + prompt_logprobs_slice_bytes(k3, 8, 2) + prefill_fixed_bytes(k3, 8) < reserve
    assert 32768 * k3.vocab_size * 4 > reserve

    tiny_k3_vocab = dataclasses.replace(preset_config("k3-tiny"), vocab_size=k3.vocab_size)
    small = EngineArgs(device="cuda", max_model_len=256, max_num_seqs=1, max_num_batched_tokens=256,
                       max_adaptive_batched_tokens=256)
    held = 256 * tiny_k3_vocab.hidden_size * 2 + k3.vocab_size * 4  # the hidden states, the sampled row's logits
    assert prefill_activation_bytes(tiny_k3_vocab, small) == (
        held + prompt_logprobs_slice_bytes(tiny_k3_vocab, 1, 2) + prefill_fixed_bytes(tiny_k3_vocab, 1))


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-k3"])
def test_the_prefill_reserve_grows_linearly_with_the_step_tokens(preset: str) -> None:
    """Each token adds the same bytes (the per-sequence and fixed terms are equal at these sizes): a step of 2048
    tokens adds to one of 1024 what one of 3072 adds to 2048."""
    config = preset_config(preset)
    tp = 8 if preset == "kimi-k3" else 1
    sizes = [prefill_activation_bytes(config, EngineArgs(**STEP, tensor_parallel_size=tp, max_num_batched_tokens=n,
                                                         max_adaptive_batched_tokens=n)) for n in (1024, 2048, 3072)]
    assert sizes[0] < sizes[1] < sizes[2] and sizes[2] - sizes[1] == sizes[1] - sizes[0]


def test_the_plan_sizes_the_step_the_engines_scheduler_runs(tiny_checkpoint: Path) -> None:
    for kw in ({}, {"max_num_batched_tokens": 96}, {"max_num_batched_tokens": 96, "max_adaptive_batched_tokens": 160}):
        engine = LLM(model=str(tiny_checkpoint), max_model_len=256, max_num_seqs=4, **kw).engine
        assert engine.scheduler.config.max_adaptive_batched_tokens == max_step_tokens(engine.args, None)


def test_graph_reserve_counts_the_static_inputs_and_grows_with_the_largest_bucket() -> None:
    config = preset_config("k3-tiny")
    small, large = EngineArgs(**GRAPHS), EngineArgs(**{**GRAPHS, "max_num_seqs": 64, "num_kda_slots": None})
    inputs = StaticDecodeInputs(64, 8, 8, 0, "meta")  # 64 rows, 64 / 8 blocks
    assert inputs.device_bytes == (2 * 64 * 8 + 64 * 5 + 65) * 8 + 64 * 8 * 4
    per_row = decode_activation_bytes(config, 1, torch.bfloat16) + config.hidden_size * 2  # + the output row
    assert graph_reserve_bytes(config, large) - graph_reserve_bytes(config, small) == (
        inputs.device_bytes - StaticDecodeInputs(4, 8, 8, 0, "meta").device_bytes + 60 * per_row)


def test_k3serve_plan_lists_the_pad_slot_and_graphs_at_tp1_and_tp2_and_neither_eager(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At TP > 1 only when NCCL is asked for (the default; with K3SERVE_TP_NCCL=0 the model's collectives are
    gloo's, which cannot be recorded, so nothing is set aside for graphs that would never be captured)."""
    config = preset_config("k3-tiny")

    def rows(**kw) -> dict[str, str]:
        return dict(describe_plan(config, EngineArgs(device="cuda", max_num_seqs=8, enable_prefix_caching=False,
                                                     **kw), 2**30))

    eager = rows(enforce_eager=True)
    monkeypatch.setenv(NCCL_SWITCH, "0")
    gloo_tp2 = rows(tensor_parallel_size=2)
    assert gloo_tp2["KDA slots for max_num_seqs=8"].startswith("8 slots") and gloo_tp2["CUDA graphs"].startswith("off")
    monkeypatch.delenv(NCCL_SWITCH)  # NCCL by default
    for graphs in (rows(), rows(tensor_parallel_size=2)):
        assert graphs["KDA slots for max_num_seqs=8 + the CUDA-graph pad slot"].startswith("9 slots")
    assert eager["KDA slots for max_num_seqs=8"].startswith("8 slots") and eager["CUDA graphs"].startswith("off")
    cached = dict(describe_plan(config, EngineArgs(device="cuda", max_num_seqs=8), 2**30))  # prefix caching: default
    assert cached["KDA slots for max_num_seqs=8 and prefix-cache checkpoints + the CUDA-graph pad slot"].startswith(
        "17 slots")


@pytest.mark.parametrize("kw", [{}, {"enforce_eager": True}, {"enable_prefix_caching": False}, {"num_kda_slots": 11}],
                         ids=["graphs", "eager", "no-prefix-cache", "explicit-slots"])
def test_k3serve_plan_counts_the_kda_slots_and_context_the_engine_allocates(kw: dict) -> None:
    """`k3serve plan` answers what an engine run with the same args gets out of the same device budget: its
    KDA slots (with prefix caching, a checkpoint slot per running request too) and its MLA context."""
    config = preset_config("k3-tiny")
    args = EngineArgs(device="cuda", max_num_seqs=8, max_model_len=64, block_size=8, **kw)
    device_bytes = 2**30
    plan = plan_engine_pools(config, args, int(device_bytes * args.gpu_memory_utilization), device_bytes)
    rows = dict(describe_plan(config, args, device_bytes))
    (slots,) = [value for key, value in rows.items() if key.startswith("KDA slots")]
    assert slots.startswith(f"{plan.num_slots + plan.pad_slot} slots")
    (prefill,) = [value for key, value in rows.items() if key.startswith("prefill activations")]
    assert prefill == f"{plan.prefill_bytes / 2**30:.2f} GiB" and plan.prefill_bytes > 0
    tokens = int(rows["tokens of context that fit"].replace(",", ""))
    assert 0 <= tokens - plan.num_tokens < args.block_size  # the engine's pools are whole blocks


def test_a_dcp_plan_gives_each_block_id_the_tokens_of_its_ranks_pages(tiny_checkpoint: Path) -> None:
    """The bytes that hold N blocks of 64 tokens on every rank hold N block ids of 4 x 64 tokens at DCP 4: the
    scheduler's capacity grows 4x, each rank's tensors keep pages of 64, and a block of 66 tokens does not split."""
    config = ModelConfig.from_dir(tiny_checkpoint)
    sizes = cache_sizes(config, 4, torch.float32)
    base = plan_pools(sizes, 8 << 20, 64, 8, 512)
    dcp = plan_pools(sizes, 8 << 20, 256, 8, 512, dcp_size=4)
    assert (dcp.num_blocks, dcp.page_size, dcp.num_tokens) == (base.num_blocks, 64, 4 * base.num_tokens)
    args = EngineArgs(model=str(tiny_checkpoint), tensor_parallel_size=4, decode_context_parallel_size=4,
                      cache_memory_bytes=8 << 20, num_kda_slots=8, max_num_seqs=8, max_model_len=512)
    assert plan_engine_pools(config, args) == dcp
    with pytest.raises(ValueError, match="blocks of 66 tokens do not split into 4 decode context parallel pages"):
        plan_pools(sizes, 8 << 20, 66, 8, 512, dcp_size=4)
