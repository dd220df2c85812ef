"""Plain-torch normalizations. All math runs in fp32 and the result is cast back to x.dtype, so a
bf16 model and this reference round only once, at the output."""

from __future__ import annotations

import torch
from torch import Tensor


def _rms_norm_fp32(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x [..., D] -> fp32 x / rms(x) (* weight [D])."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, out_dtype: torch.dtype | None = None,
             out: Tensor | None = None) -> Tensor:
    y = _rms_norm_fp32(x, weight, eps)
    return y.to(out_dtype or x.dtype) if out is None else out.copy_(y)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    # fla FusedRMSNormGated(activation="sigmoid"): the gate multiplies the normalized, scaled x.
    return (_rms_norm_fp32(x, weight, eps) * torch.sigmoid(gate.float())).to(x.dtype)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)
