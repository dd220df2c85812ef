"""Specification of config parsing: the published presets parse to the layer layout and features
of the real models, the VL wrapper is unwrapped, and every config k3serve cannot serve exactly
fails at parse time with a ConfigError whose message names the offending field."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest

from k3serve.model.config import ConfigError, ModelConfig
from k3serve.model.presets import preset_config, preset_hf_config


def _text(hf: dict[str, Any]) -> dict[str, Any]:
    return hf["text_config"] if "text_config" in hf else hf


# -- the presets ------------------------------------------------------------------------------------


def test_kimi_k3_has_69_kda_and_24_mla_layers_ending_with_two_mla() -> None:
    config = preset_config("kimi-k3")
    assert config.num_hidden_layers == 93
    assert (len(config.kda_layers), len(config.mla_layers)) == (69, 24)
    assert config.mla_layers[:3] == (3, 7, 11)  # 0-based: every 4th layer ...
    assert config.mla_layers[-2:] == (91, 92)  # ... and the last two
    assert config.is_kda_layer(0) and not config.is_kda_layer(92)


def test_kimi_k3_features() -> None:
    config = preset_config("kimi-k3")
    assert config.weight_prefix == "language_model."
    assert config.experts_mxfp4
    assert config.kda.gate_lower_bound == -5.0 and config.kda.use_full_rank_gate
    assert config.q_lora_rank == 1536 and config.mla_use_output_gate
    assert config.routed_expert_hidden_size == 3584 and config.latent_moe_use_norm
    assert config.hidden_act == "situ" and config.attn_res_block_size == 12
    assert config.mla_kv_dim == 576  # 512 latent + 64 rope per token
    assert not config.is_moe_layer(0) and config.is_moe_layer(1)  # first_k_dense_replace = 1


def test_kimi_linear_has_20_kda_and_7_mla_layers() -> None:
    config = preset_config("kimi-linear-48b-a3b")
    assert (len(config.kda_layers), len(config.mla_layers)) == (20, 7)
    assert config.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert config.weight_prefix == ""
    assert not config.experts_mxfp4
    assert config.kda.gate_lower_bound is None and not config.kda.use_full_rank_gate
    assert config.q_lora_rank is None and not config.mla_use_output_gate
    assert config.routed_expert_hidden_size is None and config.attn_res_block_size is None
    assert config.hidden_act == "silu"


def test_k3_tiny_keeps_every_k3_feature() -> None:
    tiny, k3 = preset_config("k3-tiny"), preset_config("kimi-k3")
    for feature in ("weight_prefix", "experts_mxfp4", "mla_use_output_gate", "hidden_act", "latent_moe_use_norm"):
        assert getattr(tiny, feature) == getattr(k3, feature), feature
    assert tiny.kda.gate_lower_bound == k3.kda.gate_lower_bound
    assert tiny.kda.use_full_rank_gate and tiny.q_lora_rank is not None
    assert tiny.routed_expert_hidden_size is not None and tiny.attn_res_block_size is not None
    assert tiny.mla_layers[-2:] == (5, 6)  # like K3, the last two layers are MLA


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="k3-tiny"):
        preset_hf_config("kimi-k4")


# -- the VL wrapper ---------------------------------------------------------------------------------


def test_vl_wrapper_reads_text_config_and_prefixes_language_model() -> None:
    wrapped = preset_hf_config("kimi-k3")
    flat = dict(wrapped["text_config"])
    assert ModelConfig.from_hf_dict(wrapped).weight_prefix == "language_model."
    assert ModelConfig.from_hf_dict(flat).weight_prefix == ""
    assert dataclasses.replace(ModelConfig.from_hf_dict(wrapped), weight_prefix="") == ModelConfig.from_hf_dict(flat)


def test_vl_wrapper_quantization_config_may_sit_at_the_top_level() -> None:
    hf = preset_hf_config("kimi-k3")
    hf["quantization_config"] = hf["text_config"].pop("quantization_config")
    assert ModelConfig.from_hf_dict(hf).experts_mxfp4


def test_layer_lists_are_one_based_in_the_config_and_zero_based_after_parsing() -> None:
    hf = preset_hf_config("kimi-linear-48b-a3b")
    assert hf["linear_attn_config"]["full_attn_layers"][-1] == 27
    assert preset_config("kimi-linear-48b-a3b").mla_layers[-1] == 26


# -- unsupported configs fail at parse time, naming the field ---------------------------------------


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def edit(text: dict) -> None:
        text[key] = value

    return edit


def _set_lin(key: str, value: Any) -> Callable[[dict], None]:
    def edit(text: dict) -> None:
        text["linear_attn_config"][key] = value

    return edit


def _del(key: str) -> Callable[[dict], None]:
    def edit(text: dict) -> None:
        del text[key]

    return edit


def _move_layer(layer: int, src: str, dst: str | None) -> Callable[[dict], None]:
    """Take 1-based `layer` out of list `src` and (unless dst is None) add it to `dst`."""

    def edit(text: dict) -> None:
        lin = text["linear_attn_config"]
        lin[src] = [i for i in lin[src] if i != layer]
        if dst is not None:
            lin[dst] = sorted(lin[dst] + [layer])

    return edit


def _add_layer(layer: int, dst: str) -> Callable[[dict], None]:
    def edit(text: dict) -> None:
        lin = text["linear_attn_config"]
        lin[dst] = sorted(lin[dst] + [layer])

    return edit


def _set_quant(edit_qc: Callable[[dict], None]) -> Callable[[dict], None]:
    def edit(text: dict) -> None:
        edit_qc(text["quantization_config"])

    return edit


def _quant_bits(qc: dict) -> None:
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 8


def _quant_method(qc: dict) -> None:
    qc["quant_method"] = "fp8"


REJECTED = {  # id: (edit of K3's text config, field the message must name)
    "rotary-mla": (_set("mla_use_nope", False), "mla_use_nope"),
    "mtp-heads": (_set("num_nextn_predict_layers", 1), "num_nextn_predict_layers"),
    "softmax-router": (_set("moe_router_activation_func", "softmax"), "moe_router_activation_func"),
    "grouped-topk": (_set("num_expert_group", 8), "num_expert_group"),
    "tied-embeddings": (_set("tie_word_embeddings", True), "tie_word_embeddings"),
    "layer-in-both-lists": (_add_layer(1, "full_attn_layers"), "full_attn_layers"),
    "layer-in-no-list": (_move_layer(1, "kda_layers", None), "kda_layers"),
    "layer-past-the-end": (_add_layer(94, "kda_layers"), "kda_layers"),
    "layer-zero-based": (_add_layer(0, "full_attn_layers"), "full_attn_layers"),
    "model-type": (_set("model_type", "deepseek_v3"), "model_type"),
    "quant-method": (_set_quant(_quant_method), "quant_method"),
    "quant-4bit-only": (_set_quant(_quant_bits), "num_bits"),
    "gate-lower-bound-below-5": (_set_lin("gate_lower_bound", -6.0), "gate_lower_bound"),
    "gate-lower-bound-zero": (_set_lin("gate_lower_bound", 0.0), "gate_lower_bound"),
    "grouped-value-heads": (_set_lin("num_v_heads", 48), "num_v_heads"),
    "missing-field": (_del("kv_lora_rank"), "kv_lora_rank"),
    "missing-kda-field": (lambda text: text["linear_attn_config"].pop("head_dim"), "linear_attn_config.head_dim"),
    "activation": (_set("hidden_act", "gelu"), "hidden_act"),
    "top-k-above-experts": (_set("num_experts_per_token", 1000), "num_experts_per_token"),
}


@pytest.mark.parametrize("edit, field", REJECTED.values(), ids=REJECTED.keys())
def test_unsupported_config_raises_config_error_naming_the_field(edit: Callable[[dict], None], field: str) -> None:
    hf = preset_hf_config("kimi-k3")
    edit(hf["text_config"])
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(hf)


def test_wrapper_without_kimi_linear_text_config_is_rejected() -> None:
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf_dict({"model_type": "kimi_k3", "text_config": {"model_type": "llama"}})


def test_gate_lower_bound_edges() -> None:
    hf = preset_hf_config("kimi-k3")
    hf["text_config"]["linear_attn_config"]["gate_lower_bound"] = -5.0  # closed end: allowed
    assert ModelConfig.from_hf_dict(hf).kda.gate_lower_bound == -5.0


def test_mxfp4_experts_need_dims_divisible_by_32() -> None:
    hf = preset_hf_config("k3-tiny")
    hf["text_config"]["moe_intermediate_size"] = 48
    with pytest.raises(ConfigError, match="moe_intermediate_size=48"):
        ModelConfig.from_hf_dict(hf)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_from_dir_without_config_json(tmp_path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


# -- tensor parallel sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_check_tp_accepts_sizes_dividing_every_sharded_dim(tp_size: int) -> None:
    preset_config("kimi-k3").check_tp(tp_size)
    preset_config("kimi-linear-48b-a3b").check_tp(tp_size)


@pytest.mark.parametrize(
    "preset, tp_size, field",
    [
        ("kimi-k3", 5, "num_attention_heads"),  # 96 % 5
        ("kimi-k3", 64, "num_attention_heads"),  # 96 % 64
        ("kimi-linear-48b-a3b", 3, "num_attention_heads"),  # 32 % 3
        ("kimi-k3", 0, "tensor parallel size 0"),
    ],
    ids=["k3-tp5", "k3-tp64", "linear-tp3", "tp0"],
)
def test_check_tp_names_the_dimension_that_does_not_split(preset: str, tp_size: int, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        preset_config(preset).check_tp(tp_size)


def test_check_tp_names_num_experts() -> None:
    hf = preset_hf_config("kimi-k3")
    hf["text_config"]["num_experts"] = 900  # 900 % 8 != 0, every other sharded dim splits over 8
    config = ModelConfig.from_hf_dict(hf)
    with pytest.raises(ConfigError, match="num_experts=900"):
        config.check_tp(8)
