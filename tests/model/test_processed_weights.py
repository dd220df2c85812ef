"""Weights derived at load (`process_weights_after_loading`): a model refuses to run without them, and a
reload refreshes them in place, so CUDA graphs captured over their addresses see the new weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3serve.model.config import ModelConfig
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM
from k3serve.model.weights import load_weights

from _runs import Chunk, allocate, blocks_for, forward


def test_unprocessed_weights_are_refused(tiny_checkpoint: Path) -> None:
    model = KimiForCausalLM(ModelConfig.from_dir(tiny_checkpoint))
    load_weights(model, tiny_checkpoint)
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        forward(model, allocate(model), [Chunk([1, 2], 0, blocks_for(2), 0)])


def test_reloaded_weights_are_refused_until_processed_again(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint)
    load_weights(model, tiny_checkpoint)  # the derived forms are stale now
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        forward(model, allocate(model), [Chunk([1, 2], 0, blocks_for(2), 0)])


def test_reprocessing_refreshes_derived_weights_in_place(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint, dtype=torch.bfloat16)  # bf16: the fp32 forms are copies
    layers = model.model.layers
    layer = next(x for x in layers if x.is_kda and hasattr(x, "block_sparse_moe"))
    kda = layer.self_attn
    mla = next(x.self_attn for x in layers if not x.is_kda)
    derived = {"conv": kda.conv_weight, "w_uk": mla.w_uk, "scores": layer.attn_res_scores[0]}
    before = {name: (t.data_ptr(), t.clone()) for name, t in derived.items()}
    for param in (kda.k_conv1d.weight, mla.kv_b_proj.weight, layer.self_attention_res_norm.weight):
        param.mul_(2)  # a reload with other values
    model.process_weights_after_loading()

    now = {"conv": kda.conv_weight, "w_uk": mla.w_uk, "scores": layer.attn_res_scores[0]}
    for name, t in now.items():
        assert t.data_ptr() == before[name][0], f"{name} moved"
        assert not torch.equal(t, before[name][1]), f"{name} kept its old values"
