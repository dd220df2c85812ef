"""Specification of weight loading: a checkpoint that does not match the model fails with a
WeightLoadError naming the tensor (and, for a shape mismatch, both shapes); K3's padded A_log
narrows to the real heads; each tensor-parallel rank loads its own experts and skips the rest
(loading needs no torch.distributed, only the forward all-reduce does)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3serve.model.config import ModelConfig
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM
from k3serve.model.parallel import TensorParallel
from k3serve.model.weights import WeightLoadError, checkpoint_targets, load_weights

from _checkpoint_files import read_tensor

K3_Q_PROJ = "language_model.model.layers.2.self_attn.q_b_proj.weight"  # layer 3 (1-based) is MLA
K3_A_LOG = "language_model.model.layers.0.self_attn.A_log"
K3_EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.{}.w1.weight_packed"
LINEAR_EXPERT = "model.layers.1.block_sparse_moe.experts.{}.w1.weight"


def _edited_copy(checkpoint: Path, out: Path, name: str, value: torch.Tensor | None) -> Path:
    """A copy of `checkpoint` whose shard holding `name` is rewritten with `name` set to `value`
    (None deletes it). The index is left as it was, as a hand-edited checkpoint would leave it."""
    shutil.copytree(checkpoint, out)
    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return out


def _with_extra(checkpoint: Path, out: Path, name: str, value: torch.Tensor) -> Path:
    shutil.copytree(checkpoint, out)
    shard = sorted(out.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    tensors[name] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return out


# -- clear errors ----------------------------------------------------------------------------------


def test_tiny_checkpoints_load(tiny_checkpoint: Path, kimi_linear_tiny_checkpoint: Path) -> None:
    load_model(tiny_checkpoint)
    load_model(kimi_linear_tiny_checkpoint)


def test_missing_tensor_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    broken = _edited_copy(tiny_checkpoint, tmp_path / "ckpt", K3_Q_PROJ, None)
    with pytest.raises(WeightLoadError, match=f"missing 1 tensors: {K3_Q_PROJ}"):
        load_model(broken)


def test_unexpected_tensor_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    name = "language_model.model.layers.0.self_attn.kv_b_proj.weight"  # layer 0 is KDA: no MLA kv_b_proj
    broken = _with_extra(tiny_checkpoint, tmp_path / "ckpt", name, torch.zeros(64, 32, dtype=torch.bfloat16))
    with pytest.raises(WeightLoadError, match=f"unexpected tensor '{name}'"):
        load_model(broken)


def test_unexpected_tensor_in_flat_checkpoint_is_named(kimi_linear_tiny_checkpoint: Path, tmp_path: Path) -> None:
    name = "vision_tower.patch_embed.weight"  # only a VL checkpoint may carry other towers
    broken = _with_extra(kimi_linear_tiny_checkpoint, tmp_path / "ckpt", name, torch.zeros(4))
    with pytest.raises(WeightLoadError, match=f"unexpected tensor '{name}'"):
        load_model(broken)


def test_other_towers_of_the_vl_checkpoint_are_skipped(tiny_checkpoint: Path, tmp_path: Path) -> None:
    extended = _with_extra(tiny_checkpoint, tmp_path / "ckpt", "vision_tower.patch_embed.weight", torch.zeros(4))
    load_model(extended)


def test_misshaped_tensor_names_it_and_both_shapes(tiny_checkpoint: Path, tmp_path: Path) -> None:
    good = read_tensor(tiny_checkpoint, K3_Q_PROJ)
    out, inp = good.shape
    broken = _edited_copy(tiny_checkpoint, tmp_path / "ckpt", K3_Q_PROJ, torch.zeros(out + 3, inp, dtype=good.dtype))
    with pytest.raises(WeightLoadError) as err:
        load_model(broken)
    assert K3_Q_PROJ in str(err.value)
    assert f"[{out + 3}, {inp}]" in str(err.value) and f"[{out}, {inp}]" in str(err.value)


def test_packed_experts_must_be_uint8(tiny_checkpoint: Path, tmp_path: Path) -> None:
    name = K3_EXPERT.format(0)
    good = read_tensor(tiny_checkpoint, name)
    broken = _edited_copy(tiny_checkpoint, tmp_path / "ckpt", name, good.to(torch.int8))
    with pytest.raises(WeightLoadError, match=f"{name}.*U8"):
        load_model(broken)


def test_missing_shard_file_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="model-00002-of-00002.safetensors"):
        load_model(tmp_path / "ckpt")


def test_weight_load_error_is_a_value_error() -> None:
    assert issubclass(WeightLoadError, ValueError)


# -- A_log layouts ---------------------------------------------------------------------------------


def test_k3_a_log_of_128_entries_narrows_to_the_first_heads(tiny_checkpoint: Path) -> None:
    padded = read_tensor(tiny_checkpoint, K3_A_LOG)
    model = load_model(tiny_checkpoint)
    num_heads = model.config.kda.num_heads
    assert padded.shape == (128,) and num_heads < 128
    assert torch.equal(model.model.layers[0].self_attn.A_log, padded[:num_heads])


def test_kimi_linear_a_log_of_shape_1_1_h_1_loads_per_head(kimi_linear_tiny_checkpoint: Path) -> None:
    ckpt = read_tensor(kimi_linear_tiny_checkpoint, "model.layers.0.self_attn.A_log")
    model = load_model(kimi_linear_tiny_checkpoint)
    assert ckpt.shape == (1, 1, model.config.kda.num_heads, 1)
    assert torch.equal(model.model.layers[0].self_attn.A_log, ckpt.reshape(-1))


def test_a_log_shorter_than_the_heads_names_the_tensor(tiny_checkpoint: Path, tmp_path: Path) -> None:
    broken = _edited_copy(tiny_checkpoint, tmp_path / "ckpt", K3_A_LOG, torch.zeros(2))
    with pytest.raises(WeightLoadError, match=f"{K3_A_LOG}.*2 entries for 4 KDA heads"):
        load_model(broken)


# -- tensor-parallel ranks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fixture, expert",
    [("tiny_checkpoint", K3_EXPERT), ("kimi_linear_tiny_checkpoint", LINEAR_EXPERT)],
    ids=["k3-tiny-mxfp4", "kimi-linear-tiny-bf16"],
)
def test_rank_loads_its_own_experts_and_skips_the_others(
    request: pytest.FixtureRequest, fixture: str, expert: str
) -> None:
    checkpoint = request.getfixturevalue(fixture)
    config = ModelConfig.from_dir(checkpoint)
    rank1 = KimiForCausalLM(config, TensorParallel(rank=1, world_size=2))
    load_weights(rank1, checkpoint)  # other ranks' experts are in the checkpoint, yet no error

    bank = rank1.model.layers[1].block_sparse_moe.experts
    half = config.num_experts // 2
    assert (bank.expert_start, bank.num_local) == (half, half)
    names = [n for n in checkpoint_targets(rank1) if ".layers.1.block_sparse_moe.experts." in n]
    assert {int(n.split(".experts.")[1].split(".")[0]) for n in names} == set(range(half, 2 * half))
    stack = bank.w1_packed if config.experts_mxfp4 else bank.w1_weight
    for j in range(half):
        assert torch.equal(stack[j], read_tensor(checkpoint, expert.format(half + j)).to(stack.dtype)), f"expert {half + j}"


def test_rank_loads_its_slice_of_sharded_weights(tiny_checkpoint: Path) -> None:
    config = ModelConfig.from_dir(tiny_checkpoint)
    full = read_tensor(tiny_checkpoint, K3_Q_PROJ).float()
    for rank in range(2):
        model = KimiForCausalLM(config, TensorParallel(rank=rank, world_size=2))
        load_weights(model, tiny_checkpoint)
        local = model.model.layers[2].self_attn.q_b_proj.weight  # column parallel: rows split
        rows = full.shape[0] // 2
        assert torch.equal(local, full[rank * rows : (rank + 1) * rows])
