"""Normalizations over the last dim: RMSNorm (layer norms, MLA latent norms), the sigmoid-gated
RMSNorm that closes a KDA layer (fla FusedRMSNormGated), and the q/k L2 norm of KDA.

Each function checks shapes here, then runs `triton_norm.py` (one kernel launch) when every tensor is on
CUDA, else the fp32 reference in `naive.py`; `last_backend[name]` records which. The output dtype is
x.dtype (rms_norm: out_dtype or out's dtype when given)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._backend import gpu_kernels, has_module
from . import naive

last_backend: dict[str, str] = {}  # "rms_norm" / "gated_rms_norm" / "l2_normalize" -> "triton" | "naive"

__all__ = ["rms_norm", "gated_rms_norm", "l2_normalize"]


def _check_weight(x: Tensor, weight: Tensor) -> None:
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must be [D={x.shape[-1]}] for x {tuple(x.shape)}, got {tuple(weight.shape)}")


def _check_float(name: str, t: Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")


def _implementation(name: str, *tensors: Tensor | None):
    """The module that runs op `name` on these tensors: triton_norm on CUDA, else naive."""
    if gpu_kernels(*tensors) and has_module("triton"):
        from . import triton_norm

        last_backend[name] = "triton"
        return triton_norm
    last_backend[name] = "naive"
    return naive


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, out_dtype: torch.dtype | None = None,
             out: Tensor | None = None) -> Tensor:
    """x [..., D] / rms(x) * weight [D]; weight None means no scale (e.g. attention-residual scores).
    out_dtype (default x.dtype): an fp32 x normalized straight into a bf16 model's dtype, rounded once,
    without a cast after. out: written in place and returned, e.g. x itself, so that MLA's latent is
    normalized inside the projection's row [c | k_pe] and the row goes to the cache with no concatenation;
    its dtype is the output's, its last dim must have unit stride."""
    _check_float("x", x)
    if weight is not None:
        _check_weight(x, weight)
    if out is not None:
        if out.shape != x.shape or out.stride(-1) != 1:
            raise ValueError(f"out must be {tuple(x.shape)} with a unit inner stride, got {tuple(out.shape)} "
                             f"of strides {out.stride()}")
        if out_dtype not in (None, out.dtype):
            raise ValueError(f"out_dtype {out_dtype} differs from out's dtype {out.dtype}")
        out_dtype = out.dtype
    return _implementation("rms_norm", x, weight, out).rms_norm(x, weight, eps, out_dtype, out)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """rms_norm(x, weight, eps) * sigmoid(gate); x, gate [..., D], weight [D]."""
    _check_float("x", x)
    if gate.shape != x.shape:
        raise ValueError(f"gate must match x {tuple(x.shape)}, got {tuple(gate.shape)}")
    _check_weight(x, weight)
    return _implementation("gated_rms_norm", x, gate, weight).gated_rms_norm(x, gate, weight, eps)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x [..., D] / sqrt(sum(x^2) + eps): the KDA q/k normalization (use_qk_l2norm_in_kernel)."""
    _check_float("x", x)
    return _implementation("l2_normalize", x).l2_normalize(x, eps)
