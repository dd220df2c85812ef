"""`k3-rank-slice`: one TP8 / EP8 rank of Kimi-K3 as a model one GPU serves at TP 1, cut to its first layers in
K3's order; and the checkpoint writer's parts it needs (layers kept, shards streamed, the CPU limit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3serve.model.checkpoint import first_layers, make_checkpoint
from k3serve.model.config import ConfigError, ModelConfig
from k3serve.model.model import KimiForCausalLM
from k3serve.model.parallel import TensorParallel
from k3serve.model.presets import preset_config, preset_hf_config
from k3serve.model.weights import checkpoint_targets


def _shapes(model: KimiForCausalLM) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.tensor.shape) for name, t in checkpoint_targets(model).items()}


def test_the_rank_slice_has_one_k3_ranks_shapes_at_tp8() -> None:
    """Every tensor of the slice at TP 1 is the shape rank 0 of K3 (its first 12 layers) holds at TP 8, but the
    router, whose 112 rows are the rank's experts (K3's rank scores all 896)."""
    with torch.device("meta"):
        ours = _shapes(KimiForCausalLM(preset_config("k3-rank-slice")))
        k3 = ModelConfig.from_hf_dict(first_layers(preset_hf_config("kimi-k3"), 12))
        rank0 = _shapes(KimiForCausalLM(k3, TensorParallel(0, 8)))
    router = {n for n in rank0 if ".block_sparse_moe.gate." in n}
    assert router and all(ours[n][0] == 112 and rank0[n][0] == 896 for n in router)
    assert {n: s for n, s in ours.items() if n not in router} == {n: s for n, s in rank0.items() if n not in router}


def test_the_rank_slice_keeps_k3s_layer_pattern_and_a_ranks_expert_load() -> None:
    config = preset_config("k3-rank-slice")
    assert config.num_hidden_layers == 12
    assert [i + 1 for i in config.mla_layers] == [4, 8, 12]  # MLA at every 4th, KDA elsewhere
    assert not config.is_moe_layer(0) and all(config.is_moe_layer(i) for i in range(1, 12))  # layer 1 dense
    assert (config.num_experts, config.num_experts_per_token) == (112, 2)  # 16 of 896 = 2 of a rank's 112
    assert (config.shared_intermediate, config.kda.num_heads, config.vocab_size) == (768, 12, 20480)


def test_first_layers_keeps_each_layers_kind() -> None:
    config = ModelConfig.from_hf_dict(first_layers(preset_hf_config("k3-rank-slice"), 5))
    assert ([i + 1 for i in config.kda_layers], [i + 1 for i in config.mla_layers]) == ([1, 2, 3, 5], [4])
    with pytest.raises(ConfigError, match="num_layers must be in 1..12"):
        first_layers(preset_hf_config("k3-rank-slice"), 13)


def test_the_rank_slice_is_refused_on_the_cpu_with_the_way_out(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"write it on a GPU \(--device cuda\)"):
        make_checkpoint("k3-rank-slice", tmp_path / "slice", num_layers=1, device="cpu")


def test_shards_are_streamed_in_name_order_and_hold_the_same_tensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    def tensors(out: Path) -> dict[str, torch.Tensor]:
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        loaded = {}
        for file in sorted(set(index.values())):
            loaded.update(load_file(str(out / file)))
        assert set(loaded) == set(index)
        return loaded

    two = tensors(make_checkpoint("k3-tiny", tmp_path / "two"))
    five = tensors(make_checkpoint("k3-tiny", tmp_path / "five", num_shards=5))
    assert len(set(json.loads((tmp_path / "five" / "model.safetensors.index.json").read_text())
                   ["weight_map"].values())) == 5
    assert two.keys() == five.keys() and all(torch.equal(two[n], five[n]) for n in two)


def test_a_vocabulary_past_the_corpus_is_filled_with_reserved_tokens(tmp_path: Path) -> None:
    from k3serve.model.tokenizer import Tokenizer, train_tiny_tokenizer

    train_tiny_tokenizer(tmp_path, vocab_size=20480)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.eos_token_id < 20480 and "reserved_token" in tokenizer.decode([15000])
