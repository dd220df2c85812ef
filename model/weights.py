"""Load a HF safetensors checkpoint (single file or sharded with an index) into a `KimiForCausalLM`.

Names are the published ones (`language_model.model.layers.N....` for the K3 VL wrapper,
`model.layers.N....` for Kimi Linear). Each rank reads only its slice of every sharded tensor
(safetensors slices, never the whole tensor). Routed experts stay MXFP4-packed. The vocab-parallel
tables (embedding, lm_head) may be padded past the checkpoint's vocab rows: a rank copies the real rows
of its block and zeroes the rest. Anything missing, unexpected or mis-shaped fails with the tensor's name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from k3serve.model.layers.common import Sharded
from k3serve.model.layers.mlp import RoutedExperts
from k3serve.model.layers.vocab import VocabParallel
from k3serve.model.model import KimiForCausalLM

_EXPERT = re.compile(r"^(?P<module>.*\.experts)\.(?P<suffix>\d+\.w[123]\.weight(?:_packed|_scale)?)$")


class WeightLoadError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor."""


@dataclass(frozen=True)
class _Target:
    tensor: torch.Tensor  # the parameter or buffer (or one expert's row of a stack) to fill
    tp_dim: int | None
    owner: Sharded | None  # for prepare_checkpoint_tensor
    local_name: str
    full_size: int | None = None  # the checkpoint's size of dim tp_dim; None: the ranks' shards exactly cover it


def checkpoint_targets(model: KimiForCausalLM) -> dict[str, _Target]:
    """Checkpoint tensor name -> where it goes on this rank."""
    prefix = model.config.weight_prefix
    targets: dict[str, _Target] = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            for suffix, buffer in module.checkpoint_entries().items():
                j = int(suffix.split(".")[0]) - module.expert_start
                targets[f"{prefix}{mod_name}.{suffix}"] = _Target(getattr(module, buffer)[j], None, None, buffer)
            continue
        for p_name, param in module.named_parameters(recurse=False):
            tp_dim = module.tp_dims[p_name] if isinstance(module, Sharded) else None
            owner = module if isinstance(module, Sharded) else None
            full_size = module.shard.vocab_size if isinstance(module, VocabParallel) else None
            targets[f"{prefix}{mod_name}.{p_name}"] = _Target(param.data, tp_dim, owner, p_name, full_size)
    return targets


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {model_dir}")
    return files


def load_weights(model: KimiForCausalLM, model_dir: str | Path) -> None:
    """Fill every parameter of `model` (this rank's shard) from the checkpoint in `model_dir`. The forms
    derived from the old weights are stale from here on: `process_weights_after_loading` must run again."""
    model.weights_processed = False
    targets = checkpoint_targets(model)
    prefix = model.config.weight_prefix
    tp = model.tp
    expert_modules = {m["module"] for name in targets if (m := _EXPERT.match(name))}
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                target = targets.get(name)
                if target is None:
                    if _belongs_elsewhere(name, prefix, expert_modules):
                        continue
                    raise WeightLoadError(f"unexpected tensor {name!r} in {path.name}: the model has no such weight")
                _load_one(name, f.get_slice(name), target, tp.rank, tp.world_size)
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise WeightLoadError(f"checkpoint in {model_dir} is missing {len(missing)} tensors: {shown}")


def _belongs_elsewhere(name: str, prefix: str, expert_modules: set[str]) -> bool:
    """Tensors this rank legitimately skips: other ranks' experts, and non-text towers of the VL wrapper."""
    if prefix and not name.startswith(prefix):
        return True  # e.g. vision_tower.*, mm_projector.* of the K3 VL checkpoint
    match = _EXPERT.match(name)
    return bool(match) and match["module"] in expert_modules


def _load_one(name: str, slice_, target: _Target, rank: int, world: int) -> None:
    full_shape = list(slice_.get_shape())
    tensor = target.tensor
    if target.owner is not None and type(target.owner).prepare_checkpoint_tensor is not Sharded.prepare_checkpoint_tensor:
        try:
            value = target.owner.prepare_checkpoint_tensor(target.local_name, slice_[:])
        except ValueError as e:
            raise WeightLoadError(f"tensor {name!r}: {e}") from e
        full_shape = list(value.shape)
    else:
        value = None
    expected = list(tensor.shape)
    if target.tp_dim is not None:
        expected[target.tp_dim] = target.full_size if target.full_size is not None else expected[target.tp_dim] * world
    if full_shape != expected:
        raise WeightLoadError(
            f"tensor {name!r} has shape {full_shape}, expected {expected}"
            + (f" (sharded over {world} ranks on dim {target.tp_dim})" if target.tp_dim is not None and world > 1 else "")
        )
    if tensor.dtype == torch.uint8 and slice_.get_dtype() != "U8":
        raise WeightLoadError(f"tensor {name!r} is {slice_.get_dtype()}, expected U8 (packed MXFP4)")
    if target.tp_dim is None:
        tensor.copy_((slice_[:] if value is None else value).to(tensor.dtype))
        return
    # this rank's block of the sharded dim; past the checkpoint's end (padding) it is zero
    dim, length = target.tp_dim, tensor.shape[target.tp_dim]
    start = rank * length
    real = max(0, min(length, full_shape[dim] - start))
    if real:
        index = [slice(None)] * len(full_shape)
        index[dim] = slice(start, start + real)
        value = slice_[tuple(index)] if value is None else value[tuple(index)]
        tensor.narrow(dim, 0, real).copy_(value.to(tensor.dtype))
    tensor.narrow(dim, real, length - real).zero_()
