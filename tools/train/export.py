"""A trained `TrainableK3` as a published-format checkpoint: what `model/weights.py` loads unchanged.

The tensors take the published names (`language_model.` prefix of the K3 VL wrapper, one tensor per routed
expert and projection), the published dtypes (`stored_dtype`: bf16, fp32 for conv / A_log / dt_bias / o_norm /
the router's bias) and the MXFP4 packing of the routed experts (post-training quantisation, round to nearest
even: `kernels.mxfp4.quantize_mxfp4`); A_log is padded to K3's 128 entries. `round_to_checkpoint` gives the
model those same values, so the trainer's evaluation scores exactly the weights it writes.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from torch import Tensor

from safetensors.torch import load_file

from k3serve.kernels.mxfp4.naive import dequantize_mxfp4, quantize_mxfp4
from k3serve.model.checkpoint import checkpoint_shapes, stored_dtype, write_shards
from k3serve.model.config import ModelConfig
from k3serve.model.weights import checkpoint_files
from tools.train.model import TrainableK3

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_EXPERT_STACKS = ("experts.w1", "experts.w3", "experts.w2")
_K3_A_LOG_ENTRIES = 128


def checkpoint_tensors(model: TrainableK3) -> dict[str, Tensor]:
    """Published name -> tensor as stored (CPU)."""
    config = model.config
    prefix = config.weight_prefix
    out: dict[str, Tensor] = {}
    for name, value in model.state_dict().items():
        value = value.detach().cpu()
        if name.endswith(_EXPERT_STACKS):
            stack, proj = name.rsplit(".", 1)
            for j, w in enumerate(value):
                key = f"{prefix}{stack}.{j}.{proj}.weight"
                if config.experts_mxfp4:
                    out[key + "_packed"], out[key + "_scale"] = quantize_mxfp4(w)
                else:
                    out[key] = w.to(torch.bfloat16)
            continue
        if name.endswith("A_log") and prefix:
            value = torch.cat([value, value.new_zeros(max(_K3_A_LOG_ENTRIES, value.numel()) - value.numel())])
        out[prefix + name] = value.to(stored_dtype(name, value.dtype)).contiguous()
    expected = set(checkpoint_shapes(config))
    if set(out) != expected:
        raise RuntimeError(f"the trainer's tensors do not match the engine's names: missing "
                           f"{sorted(expected - set(out))[:5]}, unexpected {sorted(set(out) - expected)[:5]}")
    return out


@torch.no_grad()
def round_to_checkpoint(model: TrainableK3) -> TrainableK3:
    """A copy of `model` holding exactly the values `checkpoint_tensors` stores (experts MXFP4-rounded when the
    config packs them), as fp32 parameters."""
    rounded = copy.deepcopy(model)
    for name, param in rounded.named_parameters():
        if name.endswith(_EXPERT_STACKS) and model.config.experts_mxfp4:
            param.copy_(dequantize_mxfp4(*quantize_mxfp4(param)))
        else:
            param.copy_(param.to(stored_dtype(name, param.dtype)).float())
    return rounded


def write_checkpoint(model: TrainableK3, hf_config: dict, tokenizer_dir: Path, out_dir: Path,
                     num_shards: int = 2) -> Path:
    """config.json, generation_config.json, sharded safetensors with an index, and the tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model)
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    write_shards(iter(sorted(tensors.items())), shapes, out_dir, num_shards)
    text = hf_config.get("text_config", hf_config)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    return out_dir


def load_trainable(checkpoint_dir: Path, chunk: int = 32) -> TrainableK3:
    """The model a `write_checkpoint` folder holds, as fp32 parameters equal to the stored values (routed experts
    dequantised into their stacks, A_log cut back to the heads): `round_to_checkpoint` of the model written."""
    config = ModelConfig.from_dir(checkpoint_dir)
    model = TrainableK3(config, chunk)
    stored: dict[str, Tensor] = {}
    for path in checkpoint_files(checkpoint_dir):
        stored |= load_file(str(path))
    prefix, state = config.weight_prefix, {}
    for name, param in model.state_dict().items():
        if name.endswith(_EXPERT_STACKS):
            stack, proj = name.rsplit(".", 1)
            keys = [f"{prefix}{stack}.{j}.{proj}.weight" for j in range(param.shape[0])]
            state[name] = torch.stack([dequantize_mxfp4(stored[k + "_packed"], stored[k + "_scale"])
                                       if config.experts_mxfp4 else stored[k].float() for k in keys])
        else:
            state[name] = stored[prefix + name].float()[: param.shape[0]] if name.endswith("A_log") \
                else stored[prefix + name].float()
    model.load_state_dict(state)
    return model
