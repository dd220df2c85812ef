"""The KDA gate cases that the Triton kernel must match the torch reference on, shared by the GPU test and the
CPU test under the Triton interpreter: K3's (12 heads of 128 on a TP8 rank, the bounded sigmoid gate,
bf16 f), Kimi Linear's softplus gate over f + dt_bias from -60 to 60 (softplus's tiny tail and its
threshold at 20), dt_bias as [H, K], fp32 f, a strided f, no tokens."""

from __future__ import annotations

from typing import Callable

import torch

from k3serve.kernels.kda import naive

from _close import assert_close


def _cases(rows: int, device: str):
    H, K = 12, 128
    a_log = torch.randn(H, device=device)
    dt_bias = torch.randn(H * K, device=device)
    yield "K3 bounded", (torch.randn(rows, H, K, device=device) * 4).bfloat16(), a_log, dt_bias, -5.0
    wide = torch.linspace(-60, 60, rows * H * K, device=device).reshape(rows, H, K)
    yield "softplus over [-60, 60]", wide, a_log.clamp(max=0), torch.zeros(H * K, device=device), None
    yield "softplus, dt_bias [H, K]", torch.randn(rows, H, K, device=device).bfloat16(), a_log, dt_bias.reshape(H, K), None
    yield "bounded, fp32 f", torch.randn(rows, 4, 16, device=device) * 8, a_log[:4], dt_bias[:64], -1.0
    yield "strided f", torch.randn(rows, H, 2 * K, device=device)[..., :K], a_log, dt_bias, -5.0
    yield "no tokens", torch.randn(0, H, K, device=device), a_log, dt_bias, None


def check_kda_gate_matches_reference(kda_gate: Callable, device: str, rows: int) -> None:
    """fp32 g within a few fp32 roundings of `naive.py` (exp/log differ in the last bits), absolutely
    within 1e-6 where g is near 0."""
    for name, f, a_log, dt_bias, lower_bound in _cases(rows, device):
        ref = naive.kda_gate(f, a_log, dt_bias, lower_bound)
        out = kda_gate(f, a_log, dt_bias, lower_bound)
        assert out.dtype == torch.float32 and out.shape == f.shape, name
        assert_close(name, ref, out, 1e-6, 1e-5)
