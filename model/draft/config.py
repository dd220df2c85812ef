"""A drafter checkpoint's config.json, checked once against the target it drafts for; every error names the field.

An EAGLE or DSpark drafter is a one-layer `kimi_linear` config (one MLA layer, a dense MLP) plus what makes it a
drafter:

    draft_method               "eagle" | "dspark": the speculative method the checkpoint serves
    architectures              ["KimiK3EagleDrafter"] | ["KimiK3DSparkDrafter"] (as written by make-checkpoint)
    dspark_target_layer_ids    dspark: the target layers (0-based) whose outputs condition the drafter
    dspark_block_size          dspark: the longest block one forward proposes (K <= it)
    dspark_noise_token_id      dspark: the token id of the block's masked positions
    dspark_markov_rank         dspark, optional: the rank of the Markov head (a previous-token bias on each block
                               row's logits, `model.markov_head.markov_w{1,2}`); absent or 0: none

It shares the target's embedding and lm_head (`vocab_size` and `hidden_size` must be the target's). A config.json
without `draft_method` is a model of its own (method `draft_model`: any K3-architecture checkpoint with the
target's vocabulary, its own embedding and lm_head).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3serve.model.config import ConfigError, ModelConfig

DRAFT_METHODS = ("eagle", "dspark")  # what a draft_method may say; no draft_method: "draft_model"
ARCHITECTURES = {"eagle": "KimiK3EagleDrafter", "dspark": "KimiK3DSparkDrafter"}


@dataclass(frozen=True)
class DrafterConfig:
    method: str
    model: ModelConfig  # eagle / dspark: the drafter's one layer (MLA + dense MLP); draft_model: the whole model
    target_layer_ids: tuple[int, ...] = ()  # dspark's conditioning layers; () for eagle (the final hidden state)
    block_size: int = 0  # dspark: the most drafts one forward proposes
    noise_token_id: int = 0  # dspark: the masked positions' token
    markov_rank: int = 0  # dspark: the Markov head's rank, 0 without one

    @property
    def aux_hidden_size(self) -> int:
        """Width of the target features one position gives the drafter."""
        return self.model.hidden_size * max(1, len(self.target_layer_ids))

    @classmethod
    def from_dir(cls, path: str | Path) -> "DrafterConfig":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"speculative_config.model: no config.json in the drafter directory {path}")
        return cls.from_hf_dict(json.loads(config_path.read_text()))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "DrafterConfig":
        method = raw.get("draft_method")
        if method is None:
            return cls("draft_model", ModelConfig.from_hf_dict(raw))
        if method not in DRAFT_METHODS:
            raise ConfigError(f"drafter config.json draft_method must be one of {list(DRAFT_METHODS)}, got {method!r}")
        model = ModelConfig.from_hf_dict(raw)
        if model.num_hidden_layers != 1 or model.mla_layers != (0,) or model.is_moe_layer(0):
            raise ConfigError("drafter config.json must describe one MLA layer with a dense MLP "
                              "(num_hidden_layers=1, linear_attn_config.full_attn_layers=[1], first_k_dense_replace=1)")
        if model.attn_res_block_size:
            raise ConfigError("drafter config.json attn_res_block_size must be unset: the drafter's layer is a plain "
                              "residual block")
        if method == "eagle":
            return cls(method, model)
        layers = raw.get("dspark_target_layer_ids")
        if not isinstance(layers, list) or not layers or any(type(i) is not int or i < 0 for i in layers):
            raise ConfigError(f"drafter config.json dspark_target_layer_ids must be a non-empty list of layer ids "
                              f">= 0, got {layers!r}")
        block, noise = raw.get("dspark_block_size"), raw.get("dspark_noise_token_id")
        if type(block) is not int or block < 1:
            raise ConfigError(f"drafter config.json dspark_block_size must be an int >= 1, got {block!r}")
        if type(noise) is not int or not 0 <= noise < model.vocab_size:
            raise ConfigError(f"drafter config.json dspark_noise_token_id must be a token id in [0, "
                              f"{model.vocab_size}), got {noise!r}")
        rank = raw.get("dspark_markov_rank", 0)
        if type(rank) is not int or rank < 0:
            raise ConfigError(f"drafter config.json dspark_markov_rank must be an int >= 0, got {rank!r}")
        return cls(method, model, tuple(layers), block, noise, rank)

    def check_fits(self, target: ModelConfig, method: str, num_speculative_tokens: int) -> None:
        """Raise ConfigError (naming the field) unless this drafter serves `method` with K drafts for `target`."""
        if self.method != method:
            why = "its config.json draft_method" if self.method != "draft_model" else "its config.json has no draft_method"
            raise ConfigError(f"speculative_config.method={method!r} but the drafter checkpoint is a {self.method!r} "
                              f"drafter ({why})")
        for name in ("vocab_size", "hidden_size") if self.method != "draft_model" else ("vocab_size",):
            mine, theirs = getattr(self.model, name), getattr(target, name)
            if mine != theirs:
                raise ConfigError(f"drafter config.json {name}={mine} does not fit the target's {name}={theirs}")
        bad = [i for i in self.target_layer_ids if i >= target.num_hidden_layers]
        if bad:
            raise ConfigError(f"drafter config.json dspark_target_layer_ids {bad} are not layers of the target "
                              f"(num_hidden_layers={target.num_hidden_layers})")
        if self.method == "dspark" and num_speculative_tokens > self.block_size:
            raise ConfigError(f"speculative_config.num_speculative_tokens={num_speculative_tokens} exceeds the "
                              f"drafter's dspark_block_size={self.block_size}")
