"""What `gpu_serving.py` prints beside its measurements: the floors of one model's serving steps, and a model of
the TP all-reduce cost that single-GPU runs of a rank slice leave out.

    prefill floor    FLOPs of a prompt's forward (projections and experts at 2 per weight element and token, the
                     MLA scores and values quadratic in the prompt, KDA's state products) / measured matmul rate
    decode floor     bytes one decode step of B requests must read (every weight but the embedding; of the routed
                     experts the expected distinct ones B tokens pick; the MLA cache of the B contexts; the KDA
                     states read and written) / measured copy rate
    TP collectives   per step, the collectives `model/` issues at TP n (`step_collectives`: the embedding's, each
                     layer's attention and MLP all-reduce, the MoE's two fp32 ones in latent and hidden space, the
                     lm_head's gather of the sampled rows), each costing latency + 2 (n - 1) / n bytes / bus
                     bandwidth (a ring all-reduce; the gather (n - 1) / n of the gathered bytes)

All sizes come from the `ModelConfig` (`checkpoint_shapes`: the checkpoint's tensors on the meta device)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3serve.engine.memory import cache_sizes
from k3serve.model.checkpoint import checkpoint_shapes
from k3serve.model.config import ModelConfig


@dataclass(frozen=True)
class Collective:
    kind: str  # "all_reduce" | "gather"
    where: str  # "embedding", "layer 3 attention", "layer 3 moe latent", ...
    bytes: int  # one rank's message


def step_collectives(config: ModelConfig, num_tokens: int, num_sampled: int, vocab_rows: int | None = None,
                     itemsize: int = 2) -> list[Collective]:
    """The collectives one rank of a TP model issues in a forward of `num_tokens` tokens (`num_sampled` of them
    sampled), in `model/`'s order: the embedding's all-reduce (model dtype), per layer the attention's (model dtype),
    then the dense MLP's (model dtype) or the MoE's (fp32: the routed sum in latent space, then the shared experts'
    in hidden space; one fp32 sum of both without a latent space), and the lm_head's gather of the sampled rows'
    logits, `vocab_rows` a rank (None: config.vocab_size, as in k3-rank-slice, which is one rank's model)."""
    h, t = config.hidden_size, num_tokens
    out = [Collective("all_reduce", "embedding", t * h * itemsize)]
    for i in range(config.num_hidden_layers):
        out.append(Collective("all_reduce", f"layer {i + 1} attention", t * h * itemsize))
        if not config.is_moe_layer(i):
            out.append(Collective("all_reduce", f"layer {i + 1} mlp", t * h * itemsize))
        elif config.routed_expert_hidden_size is None:
            out.append(Collective("all_reduce", f"layer {i + 1} moe", t * h * 4))
        else:
            out.append(Collective("all_reduce", f"layer {i + 1} moe latent", t * config.routed_expert_hidden_size * 4))
            if config.shared_intermediate:
                out.append(Collective("all_reduce", f"layer {i + 1} moe shared", t * h * 4))
    rows = config.vocab_size if vocab_rows is None else vocab_rows
    out.append(Collective("gather", "lm_head", num_sampled * rows * itemsize))
    return out


def collectives_seconds(collectives: list[Collective], tp_size: int, bus_bytes_per_s: float,
                        latency_s: float) -> float:
    """Modelled seconds of `collectives` on `tp_size` ranks (module doc)."""
    share = (tp_size - 1) / tp_size
    return sum(latency_s + (2 * share if c.kind == "all_reduce" else share * tp_size) * c.bytes / bus_bytes_per_s
               for c in collectives)


@dataclass(frozen=True)
class _Weights:
    dense_bytes: int  # every weight a step reads whole: all but the embedding and the routed experts
    dense_elements: int
    expert_bytes: int  # one routed expert of one layer (MXFP4 codes and scales)
    expert_elements: int
    moe_layers: int


def _weights(config: ModelConfig) -> _Weights:
    dense = dense_n = expert = expert_n = 0
    for name, (shape, dtype) in checkpoint_shapes(config).items():
        numel = math.prod(shape)
        if ".experts." in name:  # routed (the shared ones are `shared_experts.`): expert 0 of every MoE layer
            if ".experts.0." in name:
                expert += numel * dtype.itemsize
                expert_n += 2 * numel if name.endswith("weight_packed") else 0
        elif "embed_tokens" not in name:
            dense, dense_n = dense + numel * dtype.itemsize, dense_n + numel
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    return _Weights(dense, dense_n, expert // max(moe_layers, 1), expert_n // max(moe_layers, 1), moe_layers)


def prefill_flops(config: ModelConfig, num_tokens: int) -> float:
    """FLOPs of one prompt of `num_tokens` (module doc)."""
    w = _weights(config)
    params = w.dense_elements + w.moe_layers * config.num_experts_per_token * w.expert_elements
    mla = 2 * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim) * num_tokens ** 2 / 2  # causal
    kda = 4 * config.kda.num_heads * config.kda.head_dim ** 2 * num_tokens  # state update and output a token
    return 2 * params * num_tokens + len(config.mla_layers) * mla + len(config.kda_layers) * kda


def decode_step_bytes(config: ModelConfig, batch: int, context: int) -> float:
    """Bytes one decode step of `batch` requests of `context` cached tokens reads and writes (module doc)."""
    w = _weights(config)
    k, e = config.num_experts_per_token, config.num_experts
    experts_hit = e * (1 - (1 - k / e) ** batch)  # expected distinct experts of batch * k uniform picks
    sizes = cache_sizes(config, 1, torch.bfloat16)
    per_request = context * sizes.mla_bytes_per_token + 2 * sizes.kda_bytes_per_slot
    return w.dense_bytes + w.moe_layers * experts_hit * w.expert_bytes + batch * per_request


def handoff_bytes(config: ModelConfig, num_tokens: int) -> int:
    """Bytes of a prompt's state a prefill engine hands to a decode engine: its MLA cache and KDA state."""
    sizes = cache_sizes(config, 1, torch.bfloat16)
    return num_tokens * sizes.mla_bytes_per_token + sizes.kda_bytes_per_slot
