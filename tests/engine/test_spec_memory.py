"""Specification: the memory plan of a speculative engine. Its largest step samples up to 1 + K rows a request and
holds every KDA layer's verify records until the commit: the prefill estimate grows by exactly them (K3 at TP8,
16 requests, K = 8), and only with speculative_config."""

from __future__ import annotations

from k3serve.engine.config import EngineArgs
from k3serve.engine.memory import prefill_phase_bytes, verify_records_bytes
from k3serve.model.checkpoint import preset_hf_config
from k3serve.model.config import ModelConfig


def test_the_memory_plan_counts_verify_rows_logits_and_records() -> None:
    config = ModelConfig.from_hf_dict(preset_hf_config("kimi-k3"))
    plain = dict(model="k3-tiny", tensor_parallel_size=8, dtype="bfloat16", max_num_seqs=16)
    spec = plain | {"speculative_config": {"method": "ngram", "num_speculative_tokens": 8}}
    before, after = (prefill_phase_bytes(config, EngineArgs(**a), 141 << 30) for a in (plain, spec))
    assert after["kda"] - before["kda"] == verify_records_bytes(config, 8, 16 * 9, 2) > 0
    assert after["sampling"] == 9 * before["sampling"]  # 16 x 9 sampled rows instead of 16


def test_the_memory_plan_gives_a_drafter_its_cache_out_of_the_same_budget(echo_checkpoint, drafters) -> None:
    """One more MLA row a token (the drafter's latent cache) and scratch blocks a KDA slot, out of the same bytes."""
    from k3serve.engine.memory import CacheSizes, cache_sizes, plan_engine_pools, with_drafter
    from k3serve.engine.spec.drafter import scratch_blocks

    config = ModelConfig.from_dir(echo_checkpoint)
    plain = dict(model=str(echo_checkpoint), dtype="float32", cache_memory_bytes=8 << 20, max_model_len=512)
    spec = plain | {"speculative_config": {"method": "eagle", "model": str(drafters["eagle"]),
                                           "num_speculative_tokens": 4}}
    sizes = cache_sizes(config, 1, EngineArgs(**plain).torch_dtype, count_weights=False)
    row = config.mla_kv_dim * 4
    assert with_drafter(sizes, EngineArgs(**spec)) == CacheSizes(
        sizes.mla_bytes_per_token + row, sizes.kda_bytes_per_slot + scratch_blocks(4, 64) * 64 * row, None)
    before, after = (plan_engine_pools(config, EngineArgs(**a)) for a in (plain, spec))
    assert after.num_blocks < before.num_blocks


def test_a_draft_model_is_planned_with_its_own_layers_and_twice_its_kda_state(echo_checkpoint, drafters) -> None:
    from k3serve.engine.memory import cache_sizes, with_drafter
    from k3serve.engine.spec.drafter import scratch_blocks

    spec = EngineArgs(model=str(echo_checkpoint), dtype="float32", speculative_config={
        "method": "draft_model", "model": str(drafters["draft_model"]), "num_speculative_tokens": 8})
    target = cache_sizes(ModelConfig.from_dir(echo_checkpoint), 1, spec.torch_dtype, count_weights=False)
    own = cache_sizes(ModelConfig.from_dir(drafters["draft_model"]), 1, spec.torch_dtype, count_weights=False)
    got = with_drafter(target, spec)
    assert got.mla_bytes_per_token == target.mla_bytes_per_token + own.mla_bytes_per_token
    assert got.kda_bytes_per_slot == (target.kda_bytes_per_slot + 2 * own.kda_bytes_per_slot
                                      + scratch_blocks(8, 64) * 64 * own.mla_bytes_per_token)
