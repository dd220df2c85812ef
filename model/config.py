"""K3 model configuration: parsed once from a HF `config.json`, validated, then frozen.

Both published members of the family use `model_type: kimi_linear`: Kimi-Linear-48B-A3B (a flat
config, tensors under `model.`) and Kimi-K3 (a VL wrapper: text config under `text_config`,
tensors under `language_model.`). Everything downstream reads this dataclass and never the raw
dict, so an unsupported field fails here, with its name, instead of deep inside a layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that k3serve cannot serve exactly; the message names the field."""


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int  # K = V
    conv_kernel_size: int
    gate_lower_bound: float | None  # None: softplus gate (Kimi Linear); else bounded "safe" gate (K3)
    use_full_rank_gate: bool  # output gate: g_proj (K3) or low-rank g_a/g_b (Kimi Linear)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    # MLA (NoPE): q = q_proj(x) or q_b(norm(q_a(x)))
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    kda: KDAConfig
    kda_layers: tuple[int, ...]  # 0-based
    mla_layers: tuple[int, ...]  # 0-based
    # MLPs and MoE
    hidden_act: str  # "silu" | "situ"
    situ_beta: float
    situ_linear_beta: float
    intermediate_size: int  # dense layers
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    moe_renormalize: bool
    routed_scaling_factor: float
    routed_expert_hidden_size: int | None  # latent MoE width; None = plain MoE
    latent_moe_use_norm: bool
    attn_res_block_size: int | None  # K3 attention residuals; None = plain residual stream
    experts_mxfp4: bool  # routed experts stored as compressed-tensors mxfp4-pack-quantized
    weight_prefix: str  # "language_model." for the VL wrapper, "" otherwise
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    shared_expert_intermediate_size: int | None = None  # None: moe_intermediate_size per shared expert
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        layers = sorted(self.kda_layers + self.mla_layers)
        if layers != list(range(self.num_hidden_layers)):
            raise ConfigError(
                "linear_attn_config: kda_layers + full_attn_layers must cover every layer exactly once "
                f"(1-based 1..{self.num_hidden_layers}); got kda={_one_based(self.kda_layers)} "
                f"full_attn={_one_based(self.mla_layers)}"
            )
        if self.hidden_act not in ("silu", "situ"):
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported (silu, situ)")
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(
                f"num_experts_per_token={self.num_experts_per_token} > num_experts={self.num_experts}"
            )
        size = self.shared_expert_intermediate_size
        if size is not None and (type(size) is not int or size < 1 or not self.num_shared_experts):
            raise ConfigError(f"shared_expert_intermediate_size={size!r} must be a positive integer, with "
                              f"num_shared_experts >= 1 (got {self.num_shared_experts})")
        if self.kda.gate_lower_bound is not None and not -5.0 <= self.kda.gate_lower_bound < 0:
            raise ConfigError(f"gate_lower_bound={self.kda.gate_lower_bound} must lie in [-5, 0)")
        if self.experts_mxfp4:
            expert_in = self.routed_expert_hidden_size or self.hidden_size
            for name, dim in (("expert input", expert_in), ("moe_intermediate_size", self.moe_intermediate_size)):
                if dim % 32:
                    raise ConfigError(f"MXFP4 experts need {name}={dim} to be a multiple of 32")

    # -- derived facts used across the code base --------------------------------------------------
    def is_kda_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.kda_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_kv_dim(self) -> int:
        """Values per token per MLA layer in the latent cache: c (kv_lora_rank) + k_pe (rope dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate(self) -> int:
        """The shared experts' intermediate width, all of them together (0 without shared experts):
        `shared_expert_intermediate_size` where the config gives it (Qwen2-MoE's key; the k3-rank-slice
        preset's one rank's share of K3's), else moe_intermediate_size per shared expert."""
        if not self.num_shared_experts:
            return 0
        if self.shared_expert_intermediate_size is not None:
            return self.shared_expert_intermediate_size
        return self.moe_intermediate_size * self.num_shared_experts

    def check_tp(self, tp_size: int) -> None:
        """Raise unless every sharded dimension splits evenly over `tp_size` ranks."""
        checks = {
            "num_attention_heads (MLA)": self.num_attention_heads,
            "linear_attn_config.num_heads (KDA)": self.kda.num_heads,
            "intermediate_size": self.intermediate_size,
            "shared experts intermediate": self.shared_intermediate or self.moe_intermediate_size,
            "num_experts": self.num_experts,
        }
        for name, value in checks.items():
            if tp_size < 1 or value % tp_size:
                raise ConfigError(f"tensor parallel size {tp_size} does not divide {name}={value}")

    # -- parsing ----------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"no config.json in {path}")
        return cls.from_hf_dict(json.loads(config_path.read_text()))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse a `kimi_linear` config (flat, or wrapped in `text_config` by the K3 VL model)."""
        prefix = ""
        cfg = raw
        if "text_config" in raw:
            cfg = dict(raw["text_config"])
            prefix = "language_model."
            # The wrapper may carry the quantization config at the top level.
            if "quantization_config" not in cfg and "quantization_config" in raw:
                cfg["quantization_config"] = raw["quantization_config"]
        if cfg.get("model_type") != "kimi_linear":
            raise ConfigError(f"model_type={cfg.get('model_type')!r}: k3serve serves 'kimi_linear' models")
        _check_supported(cfg)
        lin = cfg.get("linear_attn_config") or {}
        n_layers = _req(cfg, "num_hidden_layers")
        kda_layers = tuple(i - 1 for i in lin.get("kda_layers", []))
        mla_layers = tuple(i - 1 for i in lin.get("full_attn_layers", []))
        for name, layers in (("kda_layers", kda_layers), ("full_attn_layers", mla_layers)):
            if any(not 0 <= i < n_layers for i in layers):
                raise ConfigError(f"linear_attn_config.{name} must be 1-based in 1..{n_layers}: {list(layers)}")
        return cls(
            vocab_size=_req(cfg, "vocab_size"),
            hidden_size=_req(cfg, "hidden_size"),
            num_hidden_layers=n_layers,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 1 << 20)),
            num_attention_heads=_req(cfg, "num_attention_heads"),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=_req(cfg, "kv_lora_rank"),
            qk_nope_head_dim=_req(cfg, "qk_nope_head_dim"),
            qk_rope_head_dim=_req(cfg, "qk_rope_head_dim"),
            v_head_dim=_req(cfg, "v_head_dim"),
            mla_use_output_gate=bool(cfg.get("mla_use_output_gate", False)),
            kda=KDAConfig(
                num_heads=_req(lin, "num_heads", "linear_attn_config."),
                head_dim=_req(lin, "head_dim", "linear_attn_config."),
                conv_kernel_size=int(lin.get("short_conv_kernel_size", 4)),
                gate_lower_bound=lin.get("gate_lower_bound"),
                use_full_rank_gate=bool(lin.get("use_full_rank_gate", False)),
            ),
            kda_layers=kda_layers,
            mla_layers=mla_layers,
            hidden_act=cfg.get("hidden_act", "silu"),
            situ_beta=float(cfg.get("activation_situ_beta") or 4.0),
            situ_linear_beta=float(cfg.get("activation_situ_linear_beta") or 25.0),
            intermediate_size=_req(cfg, "intermediate_size"),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0)),
            moe_layer_freq=int(cfg.get("moe_layer_freq", 1)),
            num_experts=_req(cfg, "num_experts"),
            num_experts_per_token=_req(cfg, "num_experts_per_token"),
            num_shared_experts=int(cfg.get("num_shared_experts", 0)),
            moe_intermediate_size=_req(cfg, "moe_intermediate_size"),
            moe_renormalize=bool(cfg.get("moe_renormalize", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            routed_expert_hidden_size=cfg.get("routed_expert_hidden_size"),
            latent_moe_use_norm=bool(cfg.get("latent_moe_use_norm", False)),
            attn_res_block_size=cfg.get("attn_res_block_size"),
            experts_mxfp4=_parse_quantization(cfg.get("quantization_config")),
            weight_prefix=prefix,
            bos_token_id=cfg.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_id=_first(cfg.get("eos_token_id", raw.get("eos_token_id"))),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size"),
            hf_config=raw,
        )


def _one_based(layers: tuple[int, ...]) -> list[int]:
    return [i + 1 for i in layers]


def _first(value: Any) -> int | None:
    return value[0] if isinstance(value, list) else value


def _req(cfg: dict[str, Any], key: str, where: str = "") -> Any:
    if cfg.get(key) is None:
        raise ConfigError(f"config.json is missing required field {where}{key}")
    return cfg[key]


def _check_supported(cfg: dict[str, Any]) -> None:
    """Reject configs whose math k3serve does not implement, rather than serve them wrongly."""
    if cfg.get("mla_use_nope") is False:
        raise ConfigError("mla_use_nope=false (rotary MLA) is not supported: Kimi models are NoPE")
    if cfg.get("num_nextn_predict_layers", 0):
        raise ConfigError("num_nextn_predict_layers > 0 (MTP heads) is not supported")
    if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(
            f"moe_router_activation_func={cfg['moe_router_activation_func']!r} is not supported (sigmoid)"
        )
    if cfg.get("use_grouped_topk") and (cfg.get("num_expert_group", 1), cfg.get("topk_group", 1)) != (1, 1):
        raise ConfigError(
            "grouped top-k with num_expert_group/topk_group != 1 is not supported "
            f"(got {cfg.get('num_expert_group')}/{cfg.get('topk_group')})"
        )
    if cfg.get("topk_method", "noaux_tc") not in ("noaux_tc", "greedy"):
        raise ConfigError(f"topk_method={cfg['topk_method']!r} is not supported (noaux_tc)")
    if cfg.get("tie_word_embeddings"):
        raise ConfigError("tie_word_embeddings=true is not supported: Kimi models have an untied lm_head")
    lin = cfg.get("linear_attn_config") or {}
    if lin.get("num_v_heads", lin.get("num_heads")) != lin.get("num_heads"):
        raise ConfigError("KDA with grouped value heads (num_v_heads != num_heads) is not supported")


def _parse_quantization(qc: dict[str, Any] | None) -> bool:
    """True when the routed experts are MXFP4 (compressed-tensors mxfp4-pack-quantized)."""
    if not qc:
        return False
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
        raise ConfigError(
            f"quantization_config quant_method={method!r} format={fmt!r} is not supported "
            "(compressed-tensors / mxfp4-pack-quantized)"
        )
    groups = qc.get("config_groups") or {}
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if (weights.get("num_bits"), weights.get("group_size")) != (4, 32):
            raise ConfigError(
                f"quantization_config.config_groups.{name}.weights must be num_bits=4 group_size=32 "
                f"(got {weights.get('num_bits')}/{weights.get('group_size')})"
            )
    return True
