"""Write a complete, deterministic HF-format checkpoint for a preset (`k3serve make-checkpoint`): small ones
drawn on the CPU (the same bytes everywhere), large ones (k3-rank-slice) on a GPU, written a shard at a time.

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
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from k3serve.kernels.mxfp4 import quantize_mxfp4
from k3serve.model.config import ConfigError, ModelConfig
from k3serve.model.model import KimiForCausalLM
from k3serve.model.presets import CHAT_FORMATS, preset_chat_format, preset_hf_config
from k3serve.model.tokenizer import Tokenizer, train_tiny_tokenizer
from k3serve.model.weights import checkpoint_targets

MAX_CHECKPOINT_PARAMS = 50_000_000  # drawn on a CPU, random weights for anything bigger are slow
SHARD_BYTES = 4 << 30  # a large checkpoint's shard size (about)
_FP32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")
_K3_A_LOG_ENTRIES = 128  # the published K3 checkpoint pads per-head A_log to 128 entries


def make_checkpoint(preset: str | dict, out_dir: str | Path, seed: int = 0, num_shards: int | None = None,
                    num_layers: int | None = None, device: str | None = None, chat_format: str | None = None,
                    echo_weight: float = 0.0) -> Path:
    """Write `preset` (a preset name, or a HF config dict) with random weights drawn from `seed`
    into `out_dir`; returns out_dir.

    num_layers: keep the preset's first layers only (`first_layers`). device: where the weights are drawn;
    None = the CPU for a preset of at most MAX_CHECKPOINT_PARAMS parameters (the same bytes on every
    machine), else CUDA (a GPU's generator: the same bytes on the same GPU model). num_shards: None = 2, or
    one a SHARD_BYTES of weights when there are more; shards are written one at a time (host memory holds one).
    chat_format (CHAT_FORMATS): the tokenizer's special tokens and chat format; default the preset's, "kimi_k2"
    for a dict. `echo_weight` > 0 adds that multiple of the embedding to the lm_head: a model that tends to repeat
    its last token for a while, where prompt lookup's drafts are accepted (and rejected where a run changes), for
    speculative decoding's tests and benchmarks; random weights alone almost never repeat."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = preset_hf_config(preset) if isinstance(preset, str) else copy.deepcopy(preset)
    if num_layers is not None:
        hf = first_layers(hf, num_layers)
    chat_format = chat_format or (preset_chat_format(preset) if isinstance(preset, str) else "kimi_k2")
    if chat_format not in CHAT_FORMATS:
        raise ConfigError(f"chat_format must be one of {', '.join(CHAT_FORMATS)}, got {chat_format!r}")
    text = _text_config(hf)
    train_tiny_tokenizer(out, vocab_size=text["vocab_size"], chat_format=chat_format)
    tokenizer = Tokenizer.from_dir(out)
    text["bos_token_id"], text["eos_token_id"] = tokenizer.bos_token_id, tokenizer.eos_token_id
    config = ModelConfig.from_hf_dict(hf)

    shapes = checkpoint_shapes(config)
    dev = _weights_device(shapes, device)
    gen = torch.Generator(dev).manual_seed(seed)
    tensors = _random_tensors(config, shapes, gen)
    write_shards(_with_echo(tensors, echo_weight) if echo_weight else tensors, shapes, out, num_shards)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    gen_config = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
    return out


def first_layers(hf: dict, num_layers: int) -> dict:
    """A copy of the HF config `hf` cut to its first `num_layers` layers, each of the kind it was (KDA or MLA, dense
    or MoE): K3's pattern kept."""
    hf = copy.deepcopy(hf)
    text = _text_config(hf)
    if not 1 <= num_layers <= text["num_hidden_layers"]:
        raise ConfigError(f"num_layers must be in 1..{text['num_hidden_layers']}, got {num_layers}")
    lin = text["linear_attn_config"]
    text["num_hidden_layers"] = num_layers
    lin["full_attn_layers"] = [i for i in lin["full_attn_layers"] if i <= num_layers]
    lin["kda_layers"] = [i for i in lin["kda_layers"] if i <= num_layers]
    return hf


def _text_config(hf: dict) -> dict:
    return hf["text_config"] if "text_config" in hf else hf


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of the checkpoint: name -> (shape, dtype) as stored (bf16, the fp32 ones the published
    checkpoint keeps in fp32, uint8 MXFP4 codes and scales)."""
    with torch.device("meta"):
        targets = checkpoint_targets(KimiForCausalLM(config))
    return {name: (tuple(t.tensor.shape), stored_dtype(name, t.tensor.dtype)) for name, t in targets.items()}


def stored_dtype(name: str, loaded: torch.dtype) -> torch.dtype:
    """The dtype a published checkpoint stores tensor `name` in: uint8 MXFP4 as is, fp32 for the
    _FP32_SUFFIXES, bf16 for the rest."""
    if loaded == torch.uint8:
        return loaded
    return torch.float32 if name.endswith(_FP32_SUFFIXES) else torch.bfloat16


def _num_params(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(math.prod(shape) * (2 if name.endswith("packed") else 1) for name, (shape, _) in shapes.items())


def _weights_device(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], device: str | None) -> torch.device:
    num_params = _num_params(shapes)
    if device is None:
        device = "cpu" if num_params <= MAX_CHECKPOINT_PARAMS or not torch.cuda.is_available() else "cuda"
    dev = torch.device(device)
    if dev.type == "cpu" and num_params > MAX_CHECKPOINT_PARAMS:
        raise ConfigError(
            f"make-checkpoint draws random weights on the CPU for small presets only; this one has {num_params:,} "
            f"parameters (limit {MAX_CHECKPOINT_PARAMS:,}): write it on a GPU (--device cuda)"
        )
    return dev


def _random_tensors(config: ModelConfig, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                    gen: torch.Generator) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, host tensor) in name order, drawn from `gen` on its device (an MXFP4 weight's scales right after
    its packed codes, which come first in that order too)."""
    dev = gen.device
    for name in sorted(shapes):
        shape, _ = shapes[name]
        if name.endswith("weight_scale"):
            continue  # produced together with weight_packed
        if name.endswith("weight_packed"):
            dense = torch.randn(shape[0], shape[1] * 2, generator=gen, device=dev) / math.sqrt(shape[1] * 2)
            q = quantize_mxfp4(dense)
            yield name, q.packed.cpu()
            yield name[: -len("packed")] + "scale", q.scales.cpu()
            continue
        yield name, _init(name, shape, gen, config).cpu()


def _with_echo(tensors: Iterator[tuple[str, torch.Tensor]], weight: float) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` with `weight` x the embedding added to the lm_head (held back until the embedding is drawn)."""
    head: tuple[str, torch.Tensor] | None = None
    embedding: torch.Tensor | None = None
    for name, tensor in tensors:
        if name.endswith("lm_head.weight"):
            head = (name, tensor)
        else:
            embedding = tensor if name.endswith("embed_tokens.weight") else embedding
            yield name, tensor
        if head is not None and embedding is not None:
            yield head[0], head[1] + weight * embedding
            head = None
    if head is not None:
        raise ValueError("echo_weight needs an untied lm_head and an embedding, which this checkpoint lacks")


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, config: ModelConfig) -> torch.Tensor:
    """Values of a trained model's order of magnitude, so activations stay in a sane range."""
    dev = gen.device

    def randn(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=dev)

    if name.endswith("A_log"):
        heads = shape[0]
        a_log = torch.log(torch.empty(heads, device=dev).uniform_(1, 16, generator=gen))
        if config.weight_prefix:  # K3 layout: padded 1-D
            return torch.cat([a_log, torch.zeros(max(_K3_A_LOG_ENTRIES, heads) - heads, device=dev)])
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
    return value.to(stored_dtype(name, value.dtype))


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  out: Path, num_shards: int | None) -> None:
    """Write `tensors` ((name, tensor) pairs covering `shapes`, in any order) as safetensors shards with an index.
    Shard i holds the i-th run of names in order (as many names each); each is saved once all its tensors are
    drawn, so host memory holds about one shard."""
    names = sorted(shapes)
    if num_shards is None:
        total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())
        num_shards = max(2, math.ceil(total / SHARD_BYTES))
    per_shard = math.ceil(len(names) / num_shards)
    weight_map: dict[str, str] = {}
    drawn: dict[str, torch.Tensor] = {}
    total = 0
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        group = names[i * per_shard : (i + 1) * per_shard]
        while not all(n in drawn for n in group):
            name, tensor = next(tensors)
            drawn[name] = tensor
        chunk = {n: drawn.pop(n).contiguous() for n in group}
        save_file(chunk, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
        total += sum(t.numel() * t.element_size() for t in chunk.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
