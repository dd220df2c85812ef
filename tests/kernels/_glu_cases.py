"""The GLU cases that the Triton kernel must match the torch reference on, shared by the GPU test and the CPU
test under the Triton interpreter: K3's SiTU-GLU (beta 4, linear_beta 25) on gate and up sliced out of one
stacked projection (as DenseMLP's), with values far past both caps; SwiGLU; fp32 and bf16; a width that is
not a multiple of the block; leading dims; no rows."""

from __future__ import annotations

from typing import Callable

import torch

from k3serve.kernels.moe import naive

from _close import assert_close


def _cases(rows: int, device: str):
    stacked = torch.randn(rows, 2 * 768, device=device) * 30  # past beta = 4 and, some, linear_beta = 25
    yield "K3 shared experts (TP8), stacked gate|up", stacked[:, :768], stacked[:, 768:]
    yield "width 1100", torch.randn(rows, 1100, device=device) * 3, torch.randn(rows, 1100, device=device)
    yield "leading dims", torch.randn(2, rows, 64, device=device), torch.randn(2, rows, 64, device=device)
    yield "no rows", torch.randn(0, 256, device=device), torch.randn(0, 256, device=device)


def check_glu_matches_reference(situ_glu: Callable, silu_glu: Callable, device: str, rows: int) -> None:
    """Within one output rounding of `naive.py` (tanh and sigmoid differ in the last fp32 bits). In fp32 the
    absolute slack is 1e-6 of SiTU's output scale (beta * linear_beta = 100): tanh as 2 sigmoid(2x) - 1 loses
    relative precision near 0, which the GPU showed as 4.6e-5 off on outputs of that scale."""
    for dtype, atol, rtol in ((torch.bfloat16, 8e-3, 8e-3), (torch.float32, 1e-4, 1e-5)):
        for name, gate, up in _cases(rows, device):
            gate, up = gate.to(dtype), up.to(dtype)
            out = situ_glu(gate, up, beta=4.0, linear_beta=25.0)
            assert out.dtype == dtype and out.shape == gate.shape
            assert_close(f"situ {name} {dtype}", naive.situ_glu(gate, up, 4.0, 25.0), out, atol, rtol)
            assert_close(f"silu {name} {dtype}", naive.silu_glu(gate, up), silu_glu(gate, up), atol, rtol)
