"""Linear projections, y = x @ weight^T: every GEMM of the model's layers (`model/layers/common.py`
`Linear` and `project`, the lm_head in `vocab.py`).

Decode multiplies a few rows by a large weight, where a GEMM is a weight stream: on CUDA, bf16/fp16 x of
at most 16 rows against a contiguous weight of at least 2^20 elements runs `triton_skinny.py` (one launch,
split-K reduced in the same launch, tiles by a fixed rule: `tile_rule.py`); everything else runs `naive.py`
(`F.linear`, cuBLAS on CUDA). fp32 outputs of 16-bit inputs (the MoE router's logits, the shared experts'
partial sums) take the same kernel: the router's picks must be the same on every EP rank, which takes one
summation order per shape and device model, and the tile rule fixes exactly that (as cuBLAS fixes its own).
`last_backend["linear"]` records which."""

from __future__ import annotations

import torch
from torch import Tensor

from .._backend import gpu_kernels, has_module
from . import naive

last_backend: dict[str, str] = {}  # "linear" -> "triton" | "naive"

__all__ = ["linear"]

CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""cuBLAS's workspace for one (handle, stream), as torch sizes it on Hopper with `CUBLAS_WORKSPACE_CONFIG` unset
(4096 KiB x 8; less on older GPUs); cuBLASLt keeps one as large beside it. Made at a stream's first GEMM and kept."""
MAX_TRITON_ROWS = 16  # rows of x up to which the Triton kernel runs (its widest tile)
MIN_TRITON_WEIGHT = 1 << 20  # weight elements below which a launch costs more than the stream: cuBLAS
_TRITON_DTYPES = (torch.bfloat16, torch.float16)


def linear(x: Tensor, weight: Tensor, out_dtype: torch.dtype | None = None, add: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight [N, K]^T (+ add [..., N]) -> [..., N] in out_dtype (default x.dtype). x and weight share
    one floating dtype; out_dtype may also be fp32 for 16-bit inputs: the exact products summed in fp32, rounded
    once (the router's logits). add (any float dtype: a residual, the shared experts' all-reduced partial sums)
    joins the fp32 sums before that one rounding: no launch of its own, one rounding fewer than adding after."""
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must be [..., K] and weight [N, K] with the same K, got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    if not x.is_floating_point() or x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share one floating dtype, got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device, got {x.device} and {weight.device}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be x's dtype ({x.dtype}) or torch.float32, got {out_dtype}")
    if add is not None and (add.shape != (*x.shape[:-1], weight.shape[0]) or not add.is_floating_point()
                            or add.device != x.device):
        raise ValueError(f"add must be a floating [..., N] = {(*x.shape[:-1], weight.shape[0])} tensor on "
                         f"{x.device}, got {add.dtype} {tuple(add.shape)} on {add.device}")
    if _triton_fits(x, weight) and (add is None or add.stride(-1) == 1):
        from . import triton_skinny

        last_backend["linear"] = "triton"
        rows = None if add is None else add.reshape(-1, add.shape[-1])
        out = triton_skinny.linear(x.reshape(-1, x.shape[-1]), weight, out_dtype, rows)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    last_backend["linear"] = "naive"
    return naive.linear(x, weight, out_dtype, add)


def _triton_fits(x: Tensor, weight: Tensor) -> bool:
    """CUDA tensors of a 16-bit dtype, 1..16 rows of x with a unit inner stride, a contiguous weight
    large enough to be worth a stream."""
    rows = x.shape[:-1].numel()
    return (gpu_kernels(x, weight) and has_module("triton") and x.dtype in _TRITON_DTYPES
            and 1 <= rows <= MAX_TRITON_ROWS and x.stride(-1) == 1 and weight.is_contiguous()
            and weight.numel() >= MIN_TRITON_WEIGHT)
