"""Write a complete, deterministic HF-format checkpoint for a small preset (`k3serve make-checkpoint`).

The result looks like a published one: config.json, sharded safetensors with an index, the
published tensor names (VL `language_model.` prefix for K3 presets), bf16 weights with the fp32
tensors the real checkpoint keeps in fp32, MXFP4-packed routed experts, K3's padded 128-entry
`A_log`, and a real trained BPE tokenizer. Tests and the embedded default serve it, so the real
loading path always runs.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from k3serve.kernels.mxfp4 import quantize_mxfp4
from k3serve.model.config import ConfigError, ModelConfig
from k3serve.model.model import KimiForCausalLM
from k3serve.model.presets import CHAT_FORMATS, preset_chat_format, preset_hf_config
from k3serve.model.tokenizer import Tokenizer, train_tiny_tokenizer
from k3serve.model.weights import checkpoint_targets

MAX_CHECKPOINT_PARAMS = 50_000_000  # random weights for anything bigger are useless and slow
_FP32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")
_K3_A_LOG_ENTRIES = 128  # the published K3 checkpoint pads per-head A_log to 128 entries


def make_checkpoint(preset: str | dict, out_dir: str | Path, seed: int = 0, num_shards: int = 2,
                    chat_format: str | None = None, echo_weight: float = 0.0) -> Path:
    """Write `preset` (a preset name, or a HF config dict) with random weights drawn from `seed`
    into `out_dir`; returns out_dir. `chat_format` (CHAT_FORMATS): the tokenizer's special tokens and
    chat format; default the preset's, "kimi_k2" for a dict. `echo_weight` > 0 adds that multiple of the
    embedding to the lm_head: a model that tends to repeat its last token for a while, where prompt lookup's
    drafts are accepted (and rejected where a run changes), for speculative decoding's tests and benchmarks;
    random weights alone almost never repeat."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = preset_hf_config(preset) if isinstance(preset, str) else copy.deepcopy(preset)
    chat_format = chat_format or (preset_chat_format(preset) if isinstance(preset, str) else "kimi_k2")
    if chat_format not in CHAT_FORMATS:
        raise ConfigError(f"chat_format must be one of {', '.join(CHAT_FORMATS)}, got {chat_format!r}")
    text = _text_config(hf)
    train_tiny_tokenizer(out, vocab_size=text["vocab_size"], chat_format=chat_format)
    tokenizer = Tokenizer.from_dir(out)
    text["bos_token_id"], text["eos_token_id"] = tokenizer.bos_token_id, tokenizer.eos_token_id
    config = ModelConfig.from_hf_dict(hf)

    tensors = _random_tensors(config, seed)
    if echo_weight:
        (head,) = [name for name in tensors if name.endswith("lm_head.weight")]
        (embedding,) = [name for name in tensors if name.endswith("embed_tokens.weight")]
        tensors[head] = tensors[head] + echo_weight * tensors[embedding]
    _write_shards(tensors, out, num_shards)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def _text_config(hf: dict) -> dict:
    return hf["text_config"] if "text_config" in hf else hf


def _random_tensors(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        shapes = {name: (tuple(t.tensor.shape), t.tensor.dtype) for name, t in checkpoint_targets(KimiForCausalLM(config)).items()}
    gen = torch.Generator().manual_seed(seed)
    num_params = sum(math.prod(shape) * (2 if name.endswith("packed") else 1) for name, (shape, _) in shapes.items())
    if num_params > MAX_CHECKPOINT_PARAMS:
        raise ConfigError(
            f"make-checkpoint writes random weights for small presets only; this one has {num_params:,} "
            f"parameters (limit {MAX_CHECKPOINT_PARAMS:,})"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape, dtype = shapes[name]
        if name.endswith("weight_scale"):
            continue  # produced together with weight_packed
        if name.endswith("weight_packed"):
            dense = torch.randn(shape[0], shape[1] * 2, generator=gen) / math.sqrt(shape[1] * 2)
            q = quantize_mxfp4(dense)
            tensors[name], tensors[name[: -len("packed")] + "scale"] = q.packed, q.scales
            continue
        tensors[name] = _init(name, shape, gen, config)
    return tensors


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, config: ModelConfig) -> torch.Tensor:
    """Values of a trained model's order of magnitude, so activations stay in a sane range."""
    def randn(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen)

    if name.endswith("A_log"):
        heads = shape[0]
        a_log = torch.log(torch.empty(heads).uniform_(1, 16, generator=gen))
        if config.weight_prefix:  # K3 layout: padded 1-D
            return torch.cat([a_log, torch.zeros(max(_K3_A_LOG_ENTRIES, heads) - heads)])
        return a_log.view(1, 1, heads, 1)  # Kimi Linear layout
    if name.endswith("dt_bias") or name.endswith("e_score_correction_bias"):
        value = 0.1 * randn(*shape)
    elif name.endswith("conv1d.weight"):
        value = 0.5 * randn(*shape)
    elif name.endswith("norm.weight"):
        value = 1.0 + 0.1 * randn(*shape)
    elif name.endswith("_res_proj.weight"):
        value = randn(*shape) / math.sqrt(shape[-1])
    elif name.endswith("embed_tokens.weight"):
        value = randn(*shape)
    else:  # projections [out, in]
        value = randn(*shape) / math.sqrt(shape[-1])
    dtype = torch.float32 if name.endswith(_FP32_SUFFIXES) else torch.bfloat16
    return value.to(dtype)


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    names = sorted(tensors)
    per_shard = math.ceil(len(names) / num_shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {n: tensors[n].contiguous() for n in names[i * per_shard : (i + 1) * per_shard]}
        save_file(chunk, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
        total += sum(t.numel() * t.element_size() for t in chunk.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
