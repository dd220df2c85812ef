"""CacheLayout spec: a rank's cache described in bytes, round-tripped through JSON, registered
region by region, and a compatibility hash that changes exactly when state bytes would mean
something else."""

from __future__ import annotations

import json

import pytest
import torch

from _transfer_setup import tiny_config
from k3serve.model.batch import ModelCache
from k3serve.model.config import ModelConfig
from k3serve.transfer.layout import LAYOUT_VERSION, CacheLayout, HeadSlice, compatibility_hash, register_cache
from k3serve.transfer.local import LocalBackend
from tiny_presets import kimi_linear_tiny


def test_from_cache_describes_every_region_in_bytes() -> None:
    config = tiny_config()  # 2 MLA layers (kv_dim 32 + 8), 4 KDA layers, 8 heads of 4, conv kernel 4
    cache = ModelCache.allocate(config, num_blocks=10, num_slots=3, block_size=4, tp_size=2, dtype=torch.bfloat16)
    layout = CacheLayout.from_cache(cache, config, tp_rank=1, tp_size=2)

    assert (layout.tp_size, layout.tp_rank, layout.block_size) == (2, 1, 4)
    assert (layout.kv_dtype, layout.recurrent_dtype, layout.conv_dtype) == ("bfloat16", "float32", "bfloat16")
    assert layout.region_names == (
        "mla.0", "mla.1",
        "kda_recurrent.0", "kda_recurrent.1", "kda_recurrent.2", "kda_recurrent.3",
        "kda_conv.0", "kda_conv.1", "kda_conv.2", "kda_conv.3",
    )  # fmt: skip
    mla = layout.mla[0]
    assert mla.bytes_per_block == 4 * (32 + 8) * 2
    recurrent = layout.kda_recurrent[0]
    assert (recurrent.num_heads_local, recurrent.head_k, recurrent.head_v) == (4, 4, 4)
    assert recurrent.bytes_per_slot == 4 * 4 * 4 * 4  # fp32
    conv = layout.kda_conv[0]
    assert (conv.channels_local, conv.width, conv.itemsize) == (4 * 4, 3, 2)
    assert conv.bytes_per_slot == 3 * 16 * 3 * 2
    tensors = [*cache.mla_kv, *cache.kda_recurrent, *cache.kda_conv]
    regions = [*layout.mla, *layout.kda_recurrent, *layout.kda_conv]
    assert [r.num_bytes for r in regions] == [t.numel() * t.element_size() for t in tensors]


def test_round_trips_through_json() -> None:
    config = tiny_config()
    layout = CacheLayout.from_cache(ModelCache.allocate(config, 6, 2, 4, tp_size=4), config, 3, 4)
    text = layout.to_json()
    assert CacheLayout.from_json(text) == layout
    assert CacheLayout.from_dict(json.loads(text)) == layout
    assert json.loads(text)["layout_version"] == LAYOUT_VERSION


def test_from_cache_rejects_a_cache_of_another_tp_size() -> None:
    config = tiny_config()
    cache = ModelCache.allocate(config, 6, 2, 4, tp_size=2)
    with pytest.raises(ValueError, match="kda_recurrent.0: cache tensor has shape"):
        CacheLayout.from_cache(cache, config, tp_rank=0, tp_size=4)


def test_compatibility_hash_changes_with_what_shapes_the_state() -> None:
    config = tiny_config()
    base = compatibility_hash(config, torch.bfloat16, 64)
    assert base == compatibility_hash(tiny_config(), "bfloat16", 64)  # deterministic, str or dtype
    assert base != compatibility_hash(config, torch.float16, 64)
    assert base != compatibility_hash(config, torch.bfloat16, 32)
    assert base != compatibility_hash(config, torch.bfloat16, 64, layout_version=LAYOUT_VERSION + 1)
    assert base != compatibility_hash(tiny_config(short_conv_kernel_size=3), torch.bfloat16, 64)
    assert base != compatibility_hash(tiny_config(head_dim=8), torch.bfloat16, 64)


def test_compatibility_hash_ignores_what_does_not() -> None:
    """Unrelated config.json keys must not force prefill and decode to upgrade in lockstep."""
    hf = kimi_linear_tiny()
    hf["linear_attn_config"].update(num_heads=8, head_dim=4)
    hf.update(num_attention_heads=8, num_key_value_heads=8)
    plain = ModelConfig.from_hf_dict(hf)
    hf.update(transformers_version="9.9.9", max_position_embeddings=123, eos_token_id=7)
    assert compatibility_hash(ModelConfig.from_hf_dict(hf), "bfloat16", 64) == compatibility_hash(plain, "bfloat16", 64)


def test_layouts_of_different_tp_share_the_hash() -> None:
    """TP size is bridged by the TP mapping, so it is not part of compatibility."""
    config = tiny_config()
    one = CacheLayout.from_cache(ModelCache.allocate(config, 6, 2, 4, tp_size=1), config, 0, 1)
    eight = CacheLayout.from_cache(ModelCache.allocate(config, 9, 3, 4, tp_size=8), config, 5, 8)
    assert one.compat_hash == eight.compat_hash


def test_register_cache_registers_every_tensor_under_its_region_name() -> None:
    config = tiny_config()
    cache = ModelCache.allocate(config, 6, 2, 4, tp_size=2)
    layout = CacheLayout.from_cache(cache, config, 0, 2)
    backend = LocalBackend()
    try:
        regions = register_cache(backend, cache)
        assert tuple(regions) == tuple(sorted(regions, key=layout.region_names.index))
        assert set(regions) == set(layout.region_names)
        assert regions["mla.1"].addr == cache.mla_kv[1].data_ptr()
        assert regions["kda_conv.3"].addr == cache.kda_conv[3].data_ptr()
        assert regions["kda_recurrent.2"].length == cache.kda_recurrent[2].numel() * 4
        layout.check_regions(regions)  # complete: no error
        assert set(backend.agent_info().regions) == set(regions.values())
    finally:
        backend.close()


def test_check_regions_fails_closed() -> None:
    config = tiny_config()
    cache = ModelCache.allocate(config, 6, 2, 4)
    layout = CacheLayout.from_cache(cache, config, 0, 1)
    backend = LocalBackend()
    try:
        regions = register_cache(backend, cache)
        missing = {k: v for k, v in regions.items() if not k.startswith("kda_conv")}
        with pytest.raises(ValueError, match="not registered"):
            layout.check_regions(missing)
        small = dict(regions, **{"mla.0": regions["mla.1"].__class__("mla.0", regions["mla.0"].addr, 8, "cpu")})
        with pytest.raises(ValueError, match="sizes differ"):
            layout.check_regions(small)
    finally:
        backend.close()


def test_head_slice_is_the_decode_ranks_view() -> None:
    config = tiny_config()
    layout = CacheLayout.from_cache(ModelCache.allocate(config, 6, 2, 4, tp_size=4), config, 2, 4)
    assert HeadSlice.whole_shard(layout) == HeadSlice(start=4, stop=6, view_start=4, view_heads=2)
    with pytest.raises(ValueError, match="outside its view"):
        HeadSlice(start=3, stop=5, view_start=4, view_heads=2)
