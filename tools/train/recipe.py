"""The training recipes as validated dataclasses. `Recipe`: the target model's shape (written out as a K3
`config.json`) and the optimisation's knobs, named `k3-code` (the GPU run, ~21M parameters,
docs/design/trained_model.md) and `micro` (the CPU tests, seconds). `DraftRecipe`: an EAGLE drafter trained
against a frozen target (`tools/train/draft.py`), named `k3-code-eagle` and `micro`."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from k3serve.model.presets import KIMI_K3_TEXT, MXFP4_QUANTIZATION


@dataclass(frozen=True)
class Recipe:
    # ---- model (K3 architecture: every layer kind and feature of Kimi-K3, scaled down) ----
    vocab_size: int = 4096  # the tokenizer's, special tokens included
    hidden_size: int = 256
    num_layers: int = 8  # 1-based MLA layers: every 4th and the last two, as K3
    kda_heads: int = 2
    kda_head_dim: int = 128  # K3's; the GPU kernels' shape rules want 128
    mla_heads: int = 2
    q_lora_rank: int = 128
    kv_lora_rank: int = 512  # K3's latent; the GPU MLA kernels want 512 + 64
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 512  # the dense first layer
    num_experts: int = 40
    experts_per_token: int = 4
    num_shared_experts: int = 1
    moe_intermediate_size: int = 128
    routed_expert_hidden_size: int = 128  # latent MoE width
    attn_res_block_size: int = 4
    max_position_embeddings: int = 32768
    # ---- optimisation ----
    seq_len: int = 512
    batch_size: int = 32
    steps: int = 4000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * this
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    qat_steps: int = 400  # the last steps train through MXFP4 fake-quantised experts (0: post-training only)
    bias_update_rate: float = 1e-3  # aux-loss-free load balancing of the router's correction bias
    kda_chunk: int = 32
    seed: int = 0
    val_percent: float = 2.0
    eval_every: int = 250
    eval_tokens: int = 65536  # tokens of val / held-out text each evaluation scores
    max_files: int | None = None  # a prefix of the corpus (micro runs); None: all of it

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "kda_heads", "kda_head_dim", "mla_heads",
                    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "intermediate_size", "num_experts", "experts_per_token", "moe_intermediate_size",
                    "routed_expert_hidden_size", "attn_res_block_size", "seq_len", "batch_size", "steps",
                    "kda_chunk", "eval_every", "eval_tokens")
        for name in positive:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"recipe field {name} must be a positive integer, got {value!r}")
        if self.num_layers < 4:
            raise ValueError(f"num_layers must be at least 4 (KDA layers and the MLA pattern), got {self.num_layers}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} > num_experts={self.num_experts}")
        if not 0 <= self.qat_steps <= self.steps or not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"need 0 <= qat_steps <= steps and 0 <= warmup_steps < steps, got qat_steps="
                             f"{self.qat_steps}, warmup_steps={self.warmup_steps}, steps={self.steps}")
        if self.lr <= 0 or not 0 < self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0 and 0 < min_lr_ratio <= 1, got {self.lr}, {self.min_lr_ratio}")

    def mla_layers(self) -> list[int]:
        """1-based, as config.json lists them: every 4th layer and the last two (K3's pattern)."""
        return sorted(set(range(4, self.num_layers + 1, 4)) | {self.num_layers - 1, self.num_layers})

    def hf_config(self, bos_token_id: int, eos_token_id: int) -> dict[str, Any]:
        """The K3 `config.json` (VL wrapper, MXFP4 routed experts) of this model."""
        mla = self.mla_layers()
        text = {
            **copy.deepcopy(KIMI_K3_TEXT),
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.mla_heads, "num_key_value_heads": self.mla_heads,
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "intermediate_size": self.intermediate_size, "num_experts": self.num_experts,
            "num_experts_per_token": self.experts_per_token, "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "attn_res_block_size": self.attn_res_block_size,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
            "quantization_config": copy.deepcopy(MXFP4_QUANTIZATION),
        }
        text["linear_attn_config"] = {
            **text["linear_attn_config"], "full_attn_layers": mla,
            "kda_layers": [i for i in range(1, self.num_layers + 1) if i not in mla],
            "num_heads": self.kda_heads, "head_dim": self.kda_head_dim,
        }
        return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text}

    def replace(self, **changes: Any) -> "Recipe":
        return dataclasses.replace(self, **changes)


RECIPES: dict[str, Recipe] = {
    "k3-code": Recipe(),
    "micro": Recipe(
        vocab_size=512, hidden_size=64, num_layers=4, kda_heads=2, kda_head_dim=16, mla_heads=2, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
        num_experts=4, experts_per_token=2, moe_intermediate_size=32,
        routed_expert_hidden_size=32, attn_res_block_size=2, seq_len=64, batch_size=4, steps=30, lr=1e-2,
        warmup_steps=3, qat_steps=5, kda_chunk=16, eval_every=15, eval_tokens=1024, max_files=40,
    ),
}


@dataclass(frozen=True)
class DraftRecipe:
    """An EAGLE drafter for a frozen target: the drafter's one layer takes the target's widths except its dense
    MLP (`intermediate_size`, small so that target and drafter stay within 25 MB); training unrolls `unroll` draft
    steps (EAGLE-3's training-time test), depth d weighted `depth_decay` ** (d - 1), each against the target's
    next-token distribution."""

    intermediate_size: int = 128
    unroll: int = 4  # draft steps trained per position (the engine drafts K of them, each from the last)
    depth_decay: float = 0.8
    seq_len: int = 512
    batch_size: int = 32
    steps: int = 1500
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    val_percent: float = 2.0  # must be the target's: the same validation files
    eval_every: int = 250
    eval_tokens: int = 32768
    max_files: int | None = None

    def __post_init__(self) -> None:
        for name in ("intermediate_size", "unroll", "seq_len", "batch_size", "steps", "eval_every", "eval_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"draft recipe field {name} must be a positive integer, got {value!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"need 0 <= warmup_steps < steps, got {self.warmup_steps}, {self.steps}")
        if self.lr <= 0 or not 0 < self.min_lr_ratio <= 1 or not 0 < self.depth_decay <= 1:
            raise ValueError(f"need lr > 0, 0 < min_lr_ratio <= 1 and 0 < depth_decay <= 1, got {self.lr}, "
                             f"{self.min_lr_ratio}, {self.depth_decay}")

    def replace(self, **changes: Any) -> "DraftRecipe":
        return dataclasses.replace(self, **changes)


DRAFT_RECIPES: dict[str, DraftRecipe] = {
    "k3-code-eagle": DraftRecipe(),
    "micro": DraftRecipe(intermediate_size=32, unroll=3, seq_len=32, batch_size=4, steps=8, warmup_steps=2,
                         lr=1e-2, eval_every=4, eval_tokens=256, max_files=12),
}


def parse_overrides(pairs: list[str], recipe_type: type = Recipe) -> dict[str, Any]:
    """["steps=100", "lr=1e-3", "max_files=none"] -> typed fields of `recipe_type`; ValueError naming a bad one."""
    fields = {f.name: f for f in dataclasses.fields(recipe_type)}
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set takes FIELD=VALUE with FIELD one of {', '.join(fields)}; got {pair!r}")
        default = getattr(recipe_type(), name)
        if text.lower() == "none" and name == "max_files":
            out[name] = None
            continue
        kind = float if isinstance(default, float) else int
        try:
            out[name] = kind(text)
        except ValueError:
            raise ValueError(f"--set {name} wants {kind.__name__}, got {text!r}") from None
    return out
