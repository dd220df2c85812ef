"""The sigmoid output gate: x * sigmoid(gate), elementwise (K3's MLA output gate, `mla_use_output_gate`,
applied to the attention output before o_proj).

`sigmoid_gate` checks shapes here, then runs `triton_gate.py` (one launch) when both tensors are on CUDA,
else the fp32 reference in `naive.py` (4 launches on a GPU: widen the gate, sigmoid, multiply, round);
`last_backend["sigmoid_gate"]` records which."""

from __future__ import annotations

import torch
from torch import Tensor

from .._backend import gpu_kernels, has_module
from . import naive

last_backend: dict[str, str] = {}  # "sigmoid_gate" -> "triton" | "naive"

__all__ = ["sigmoid_gate"]


def sigmoid_gate(x: Tensor, gate: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """x [..., N] * sigmoid(gate [..., N]) in fp32, rounded once into out_dtype (default x.dtype): MLA's fp32
    attention output gated straight into the model's dtype. gate may be a column slice of a wider
    projection (any row stride)."""
    if x.shape != gate.shape:
        raise ValueError(f"x and gate must match, got {tuple(x.shape)} and {tuple(gate.shape)}")
    if not x.is_floating_point() or not gate.is_floating_point():
        raise ValueError(f"x and gate must be floating, got {x.dtype} and {gate.dtype}")
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be floating, got {out_dtype}")
    if gpu_kernels(x, gate) and has_module("triton"):
        from . import triton_gate

        last_backend["sigmoid_gate"] = "triton"
        return triton_gate.sigmoid_gate(x, gate, out_dtype or x.dtype)
    last_backend["sigmoid_gate"] = "naive"
    return naive.sigmoid_gate(x, gate, out_dtype or x.dtype)
