"""A random drafter for a given target (`k3serve make-checkpoint --drafter eagle|dspark --target DIR`): its
config.json (`config.py`'s fields over the target's text config cut to one MLA layer with a dense MLP) and one
safetensors file of its own tensors (the embedding and lm_head stay the target's). Deterministic per seed.

`echo_weight` > 0 makes a drafter that proposes the last token again (EAGLE: fc's embedding half gets that
multiple of the identity; DSpark: its Markov head favours the previous token; both: the layer's output projections
are scaled down so the embedding carries through the residual): over an `echo_weight` target (`model/checkpoint.py`), which repeats itself for a while, its drafts
are accepted often enough for tests and benchmarks to mean something. Random weights alone are almost never right.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from k3serve.model.checkpoint import _init, write_shards
from k3serve.model.config import ConfigError, ModelConfig
from k3serve.model.draft.config import ARCHITECTURES, DRAFT_METHODS, DrafterConfig
from k3serve.model.draft.loader import DRAFTERS
from k3serve.model.weights import checkpoint_targets

_ECHO_DAMPING = 0.1  # the layer's contribution to the residual, relative to random, in an echo drafter
_MARKOV_ECHO = 10.0  # an echo DSpark's Markov bias for repeating the previous token, per unit of echo_weight


def drafter_hf_config(method: str, target_dir: str | Path, target_layer_ids: list[int] | None = None,
                      block_size: int = 8, markov_rank: int = 32, intermediate_size: int | None = None) -> dict:
    """The drafter config.json for the target in `target_dir` (dspark: conditioned on `target_layer_ids`, default
    the first, a middle and the last layer; `block_size` the most drafts a forward; a Markov head of
    `markov_rank`, 0 for none); its dense MLP `intermediate_size` wide (default the target's)."""
    if method not in DRAFT_METHODS:
        raise ConfigError(f"--drafter must be one of {list(DRAFT_METHODS)}, got {method!r}")
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    text = copy.deepcopy(raw.get("text_config", raw))
    target = ModelConfig.from_hf_dict(raw)
    for key in ("quantization_config", "attn_res_block_size"):
        text.pop(key, None)
    text["num_hidden_layers"] = 1
    text["first_k_dense_replace"] = 1
    if intermediate_size is not None:
        text["intermediate_size"] = intermediate_size
    text["linear_attn_config"] = {**text["linear_attn_config"], "full_attn_layers": [1], "kda_layers": []}
    text["architectures"] = [ARCHITECTURES[method]]
    text["draft_method"] = method
    if method == "dspark":
        n = target.num_hidden_layers
        text["dspark_target_layer_ids"] = target_layer_ids or sorted({0, n // 2, n - 1})
        text["dspark_block_size"] = block_size
        text["dspark_noise_token_id"] = target.vocab_size - 1
        text["dspark_markov_rank"] = markov_rank
    return text


def make_drafter_checkpoint(method: str, target_dir: str | Path, out_dir: str | Path, seed: int = 0,
                            echo_weight: float = 0.0, target_layer_ids: list[int] | None = None,
                            block_size: int = 8, markov_rank: int = 32) -> Path:
    """Write a random `method` drafter for the target in `target_dir` into `out_dir`; returns out_dir."""
    hf = drafter_hf_config(method, target_dir, target_layer_ids, block_size, markov_rank)
    config = DrafterConfig.from_hf_dict(hf)
    config.check_fits(ModelConfig.from_dir(target_dir), method, 1)
    with torch.device("meta"):
        shapes = {name: tuple(t.tensor.shape)
                  for name, t in checkpoint_targets(DRAFTERS[method](config, torch.float32)).items()}
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _init(name, shapes[name], gen, config.model) for name in sorted(shapes)}
    if echo_weight:
        hidden = config.model.hidden_size
        if method == "eagle":
            fc = tensors["model.fc.weight"].float()
            fc[:, :hidden] += echo_weight * torch.eye(hidden)
            tensors["model.fc.weight"] = fc.to(torch.bfloat16)
        if method == "dspark" and markov_rank:  # w2 = w1 scaled: the bias after a token peaks at that token
            w1 = torch.randn(config.model.vocab_size, markov_rank, generator=gen)
            tensors["model.markov_head.markov_w1.weight"] = w1.to(torch.bfloat16)
            tensors["model.markov_head.markov_w2.weight"] = (_MARKOV_ECHO * echo_weight / markov_rank * w1).to(
                torch.bfloat16)
        for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
            tensors[name] = (tensors[name].float() * _ECHO_DAMPING).to(torch.bfloat16)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_shards(iter(tensors.items()), {n: (s, tensors[n].dtype) for n, s in shapes.items()}, out, 1)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out
