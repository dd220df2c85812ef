"""The sigmoid-gate cases that the Triton kernel must match the torch reference on, shared by the GPU test and
the CPU test under the Triton interpreter: K3's MLA output gate at TP8 (fp32 attention output of 8 heads x 128,
the bf16 gate a column slice of the fused projection of x, rounded into bf16), fp32 throughout, a width that is
not a multiple of the block, leading dims, no rows."""

from __future__ import annotations

from typing import Callable

import torch

from k3serve.kernels.gate import naive

from _close import assert_close


def _cases(rows: int, device: str):
    fused = (torch.randn(rows, 1536 + 576 + 1024, device=device) * 4).bfloat16()  # q_a | kv_a | gate
    o = torch.randn(rows, 1024, device=device)
    yield "K3 MLA (TP8) into bf16", o, fused[:, 1536 + 576 :], torch.bfloat16
    yield "fp32", o, fused[:, 1536 + 576 :].float(), torch.float32
    wide = torch.randn(2, rows, 1100, device=device)
    yield "width 1100", wide[0], wide[1] * 4, torch.bfloat16
    heads = torch.randn(2, rows, 4, 64, device=device)
    yield "leading dims", heads[0], heads[1] * 4, torch.float32
    yield "no rows", torch.randn(0, 256, device=device), torch.randn(0, 256, device=device), torch.bfloat16


def check_gate_matches_reference(sigmoid_gate: Callable, device: str, rows: int) -> None:
    """Within one output rounding of `naive.py` (sigmoid may differ in its last fp32 bits)."""
    for name, x, gate, out_dtype in _cases(rows, device):
        out = sigmoid_gate(x, gate, out_dtype)
        assert out.dtype == out_dtype and out.shape == x.shape and out.is_contiguous(), name
        tol = 8e-3 if out_dtype == torch.bfloat16 else 1e-6
        assert_close(name, naive.sigmoid_gate(x, gate, out_dtype), out, tol, tol)
