"""Plain-torch MoE routing, GLU activations and expert evaluation (fp32 math), model/K3_MODEL.md §1e, §4."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from k3serve.kernels.mxfp4 import MXFP4Tensor

if TYPE_CHECKING:
    from . import ExpertWeights


def select_experts(
    router_logits: Tensor, correction_bias: Tensor | None, top_k: int, renormalize: bool, scaling_factor: float
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 noaux_tc routing: the bias steers selection only; weights are the unbiased sigmoid scores.
    The ids come in descending biased score, equal scores by ascending expert id (a stable sort: the order
    of torch.topk among ties is unspecified, and the GPU kernel must be checkable against this)."""
    scores = torch.sigmoid(router_logits.float())  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    topk_ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, k] int64
    topk_weights = scores.gather(-1, topk_ids)  # [T, k]
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * scaling_factor, topk_ids


def situ_glu(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """K3 SiTU-GLU: a tanh-capped SiLU gate times a tanh-capped linear up; fp32 math, input dtype out."""
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def silu_glu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU (Kimi Linear): silu(gate) * up; fp32 math, input dtype out."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _expert_weight(w: Tensor | MXFP4Tensor, e: int) -> Tensor:
    """Weight of local expert e in fp32, dequantizing only that expert."""
    if isinstance(w, MXFP4Tensor):
        return MXFP4Tensor(w.packed[e], w.scales[e]).dequantize(torch.float32)
    return w[e].float()


def round_to_mxfp8(x: Tensor) -> Tensor:
    """x [..., K] (K % 32 == 0) -> fp32 [..., K], the values its MXFP8 encoding holds, as the Blackwell experts
    (`triton_scaled._mxfp8`) quantize activations: per 32 contiguous elements the E8M0 scale 2^(s-127) with s the least
    in [0, 254] for which amax <= 448 · 2^(s-127) (no element saturates), elements rounded to E4M3 nearest-even."""
    groups = x.float().unflatten(-1, (-1, 32))  # [..., K/32, 32]
    amax = groups.abs().amax(dim=-1, keepdim=True)
    mantissa, exponent = torch.frexp(amax)  # amax = m · 2^e, m in [0.5, 1): 448 = 0.875 · 2^9
    s = (exponent.to(torch.int32) + 118 + (mantissa > 0.875).to(torch.int32)).clamp(0, 254)
    s = torch.where(amax > 0, s, torch.zeros_like(s))
    scale = torch.ldexp(torch.ones_like(amax), s - 127)
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).flatten(-2)


def round_to_mxfp8_pair(x: Tensor) -> Tensor:
    """x [..., K] -> fp32 [..., K], the sum of the two MXFP8 terms the Blackwell experts multiply: x rounded
    (`round_to_mxfp8`), plus its residual rounded."""
    hi = round_to_mxfp8(x)
    return hi + round_to_mxfp8(x.float() - hi)


def fused_experts(
    x: Tensor,
    weights: ExpertWeights,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: Callable[[Tensor, Tensor], Tensor],
    expert_start: int = 0,
) -> Tensor:
    """out[t] = Σ_j topk_weights[t, j] · W2(act(W1 x_t, W3 x_t)) over the local experts; fp32 [T, D]."""
    num_local = weights.w1.shape[0]
    local_ids = topk_ids.long() - expert_start  # [T, k]; outside [0, num_local) lives on another rank
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)  # [T, D]
    is_local = (local_ids >= 0) & (local_ids < num_local)
    for e in torch.unique(local_ids[is_local]).tolist():
        token_idx, slot_idx = torch.nonzero(local_ids == e, as_tuple=True)  # [n_e] each
        xe = x[token_idx].float()  # [n_e, D]
        gate = xe @ _expert_weight(weights.w1, e).T  # [n_e, I]
        up = xe @ _expert_weight(weights.w3, e).T  # [n_e, I]
        ye = activation(gate, up).float() @ _expert_weight(weights.w2, e).T  # [n_e, D]
        out.index_add_(0, token_idx, ye * topk_weights[token_idx, slot_idx].float().unsqueeze(-1))
    return out
