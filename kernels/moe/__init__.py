"""MoE: sigmoid + correction-bias top-k routing, GLU activations and the routed-expert sum.

Expert parallelism: a rank holds E local experts with global ids [expert_start, expert_start + E);
`fused_experts` adds only their contributions, so the full result is the sum over ranks.
On CUDA, routing and the standalone GLUs run one Triton launch each (`triton_router.py`, `triton_glu.py`),
and bf16 activations with MXFP4 banks and a SiTU/SwiGLU activation run the Triton w4a16 kernels
(`triton_moe.py`; on sm_100 / sm_103 the block-scaled MMAs of `triton_scaled.py`, activations as two MXFP8 terms);
everything else runs `naive.py`. `last_backend[name]` records which.

The finalize (each token's weighted sum over its top-k experts) is fused into the experts' down kernel;
`finalize="unfused"` is its baseline: every (token, expert) pair its own row of weight 1 through the same
kernels, an fp32 [T * k, D] intermediate, then the weighted sum as a separate op (no host sync, so it
records into CUDA graphs too); `last_backend["moe_finalize"]` records which ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from k3serve.kernels.mxfp4 import MXFP4Tensor

from .._backend import AUTOTUNE_FLUSH_BYTES, gpu_kernels, has_module
from . import naive

last_backend: dict[str, str] = {}  # op name ("select_experts", "situ_glu", ...) -> "triton" | "naive"

__all__ = ["ExpertWeights", "select_experts", "situ_glu", "silu_glu", "fused_experts", "fused_experts_workspace_bytes"]


def fused_experts_workspace_bytes(num_tokens: int, top_k: int, hidden: int, intermediate: int, itemsize: int) -> int:
    """Peak bytes `fused_experts` allocates on the Triton MXFP4 path (`triton_moe.py`) for `num_tokens` tokens of
    `top_k` picks each, experts of width D = `hidden` and I = `intermediate`, activations of `itemsize` bytes: the
    tokens' contiguous copy [T, D], the fp32 sum [T, D], h [T * top_k, I], the routing's sort and per-pair weights
    (int32 keys, int64 order, int32 copies, fp32 weight: 32 B a pair); plus the autotuner's flush buffer
    (`AUTOTUNE_FLUSH_BYTES`) for a new row bucket. Its arguments and the picks are the caller's."""
    T, b = num_tokens, itemsize
    return T * (hidden * (b + 4) + top_k * (intermediate * b + 32)) + AUTOTUNE_FLUSH_BYTES


@dataclass(frozen=True)
class ExpertWeights:
    """The local expert bank, dense or MXFP4 (checkpoint names: w1 = gate, w3 = up, w2 = down)."""

    w1: Tensor | MXFP4Tensor  # gate [E, I, D]
    w3: Tensor | MXFP4Tensor  # up [E, I, D]
    w2: Tensor | MXFP4Tensor  # down [E, D, I]

    def __post_init__(self) -> None:
        s1, s3, s2 = tuple(self.w1.shape), tuple(self.w3.shape), tuple(self.w2.shape)
        if len(s1) != 3 or s1 != s3 or s2 != (s1[0], s1[2], s1[1]):
            raise ValueError(f"expected w1 = w3 = [E, I, D] and w2 = [E, D, I], got w1 {s1}, w3 {s3}, w2 {s2}")


def select_experts(
    router_logits: Tensor, correction_bias: Tensor | None, top_k: int, renormalize: bool, scaling_factor: float
) -> tuple[Tensor, Tensor]:
    """router_logits [T, E] -> (topk_weights fp32 [T, k], topk_ids int64 [T, k]).

    Selection uses sigmoid(logits) + correction_bias; weights are sigmoid scores of the chosen experts
    (no bias), optionally renormalized to sum 1 (+1e-20), then times scaling_factor. The ids come in
    descending biased score, equal scores by ascending id. On CUDA one Triton launch (`triton_router.py`,
    E <= 1024, top_k <= 32)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(f"correction_bias must be [E={num_experts}], got {tuple(correction_bias.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, E={num_experts}]")
    if gpu_kernels(router_logits, correction_bias) and has_module("triton"):
        from . import triton_router

        if triton_router.supports(router_logits, top_k):
            last_backend["select_experts"] = "triton"
            return triton_router.select_experts(router_logits, correction_bias, top_k, renormalize, scaling_factor)
    last_backend["select_experts"] = "naive"
    return naive.select_experts(router_logits, correction_bias, top_k, renormalize, scaling_factor)


def situ_glu(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta) (K3: beta 4, linear_beta 25).

    gate, up [..., I]; fp32 math, returns gate.dtype. On CUDA one Triton launch (`triton_glu.py`)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must match, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if beta <= 0 or linear_beta <= 0:
        raise ValueError(f"beta={beta} and linear_beta={linear_beta} must be positive")
    if _glu_on_gpu("situ_glu", gate, up):
        from . import triton_glu

        return triton_glu.glu(gate, up, True, beta, linear_beta)
    return naive.situ_glu(gate, up, beta, linear_beta)


def silu_glu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up (Kimi Linear SwiGLU). gate, up [..., I]; fp32 math, returns gate.dtype. On CUDA one
    Triton launch (`triton_glu.py`)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must match, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if _glu_on_gpu("silu_glu", gate, up):
        from . import triton_glu

        return triton_glu.glu(gate, up, False)
    return naive.silu_glu(gate, up)


def _glu_on_gpu(name: str, gate: Tensor, up: Tensor) -> bool:
    """Whether GLU `name` runs `triton_glu.py` (recorded in last_backend): floating tensors on CUDA."""
    triton = gpu_kernels(gate, up) and has_module("triton") and gate.is_floating_point() and up.is_floating_point()
    last_backend[name] = "triton" if triton else "naive"
    return triton


def fused_experts(
    x: Tensor,
    weights: ExpertWeights,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: Callable[[Tensor, Tensor], Tensor],
    expert_start: int = 0,
    finalize: Literal["fused", "unfused"] = "fused",
) -> Tensor:
    """x [T, D] -> fp32 [T, D] = Σ_j topk_weights[t, j] · E_{topk_ids[t, j]}(x_t), E(x) = W2 act(W1 x, W3 x).

    Only ids in [expert_start, expert_start + E) contribute (the rest live on other EP ranks). The result
    is unreduced fp32 so TP/EP partial sums can be all-reduced before any norm (K3 latent MoE).
    finalize: "fused" (the weighted top-k sum inside the kernels) or "unfused" (its baseline, module doc)."""
    if x.dim() != 2 or x.shape[1] != weights.w1.shape[2]:
        raise ValueError(f"x must be [T, D={weights.w1.shape[2]}], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights and topk_ids must both be [T={x.shape[0]}, k], "
            f"got {tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}"
        )
    if topk_ids.is_floating_point() or topk_ids.is_complex():
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if expert_start < 0:
        raise ValueError(f"expert_start={expert_start} must be >= 0")
    if finalize not in ("fused", "unfused"):
        raise ValueError(f"finalize must be 'fused' or 'unfused', got {finalize!r}")
    last_backend["moe_finalize"] = finalize
    if finalize == "unfused":
        return _unfused_experts(x, weights, topk_weights, topk_ids, activation, expert_start)
    return _experts(x, weights, topk_weights, topk_ids, activation, expert_start)


def _experts(x: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor,
             activation: Callable[[Tensor, Tensor], Tensor], expert_start: int, path_tokens: int | None = None) -> Tensor:
    """`fused_experts` on validated inputs, its finalize fused; on the Triton kernels the pair picked for
    `path_tokens` tokens (None: for x's)."""
    mxfp4 = all(isinstance(w, MXFP4Tensor) for w in (weights.w1, weights.w3, weights.w2))
    if mxfp4 and gpu_kernels(x, weights.w1.packed, topk_weights, topk_ids) and has_module("triton"):
        from . import triton_moe

        if triton_moe.supports(x, weights, activation):
            last_backend["fused_experts"] = "triton"
            return triton_moe.fused_experts(x, weights, topk_weights, topk_ids, activation, expert_start,
                                           path=triton_moe.kernel_pair(path_tokens or x.shape[0], x.device))
    last_backend["fused_experts"] = "naive"
    return naive.fused_experts(x, weights, topk_weights, topk_ids, activation, expert_start)


def _unfused_experts(x: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor,
                     activation: Callable[[Tensor, Tensor], Tensor], expert_start: int) -> Tensor:
    """The finalize's baseline: pair t * k + j = x_t routed to expert topk_ids[t, j] alone with weight 1, through
    the kernel pair the fused call would pick for T tokens, then Σ_j topk_weights[t, j] · y[t * k + j]."""
    T, k = topk_ids.shape
    x_pairs = x.repeat_interleave(k, dim=0)  # [T * k, D]
    ones = torch.ones(T * k, 1, dtype=topk_weights.dtype, device=topk_weights.device)
    y = _experts(x_pairs, weights, ones, topk_ids.reshape(T * k, 1), activation, expert_start,
                 path_tokens=T)  # fp32 [T * k, D]
    return (y.view(T, k, -1) * topk_weights.float().unsqueeze(-1)).sum(dim=1)
