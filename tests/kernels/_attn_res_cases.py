"""The attention-residual cases that the Triton kernel must match the torch reference on, shared by the GPU
test and the CPU test under the Triton interpreter: K3's shape (hidden 7168, bank + prefix = 2 sources),
a longer bank of sources at very different scales (a saturated softmax), one source, a hidden size that
is not a power of two, the leading rows of a larger bank (as the model passes `sources[:k + 1]`), no
tokens, each with and without the fused RMSNorm, in bf16 and fp32."""

from __future__ import annotations

from typing import Callable

import torch

from k3serve.kernels.attn_res import naive

from _close import assert_close

EPS, NORM_EPS = 1e-6, 1e-5


def _cases(rows: int, device: str, dtype: torch.dtype):
    k3 = torch.randn(2, rows, 7168, device=device) * torch.tensor([[[1.0]], [[3.0]]], device=device)
    scales = torch.tensor([0.01, 1.0, 30.0, 2.0, 0.5], device=device).reshape(5, 1, 1)
    bank = torch.randn(6, rows, 96, device=device)
    yield "K3 bank + prefix", k3.to(dtype)
    yield "five sources, scales 0.01..30", (torch.randn(5, rows, 96, device=device) * scales).to(dtype)
    yield "one source", torch.randn(1, rows, 7168, device=device).to(dtype)
    yield "hidden 40", torch.randn(3, rows, 40, device=device).to(dtype)
    yield "rows 0..3 of a bank of 6", bank.to(dtype)[:4]
    yield "no tokens", torch.randn(3, 0, 96, device=device).to(dtype)


def check_attn_res_matches_reference(aggregate: Callable, device: str, rows: int) -> None:
    """Every case within one output rounding of `naive.py` (the fp32 sum orders differ); one source
    comes back bit-exactly."""
    for dtype, tol in ((torch.bfloat16, 8e-3), (torch.float32, 2e-5)):
        for name, sources in _cases(rows, device, dtype):
            D = sources.shape[-1]
            score_weight = torch.randn(D, device=device) / D**0.5
            norm_weight = (1 + 0.1 * torch.randn(D, device=device)).to(dtype)
            ref = naive.attn_res_aggregate(sources, score_weight, EPS)
            out = aggregate(sources, score_weight, EPS)
            assert out.dtype == dtype and out.is_contiguous()
            assert_close(f"{name} {dtype}", ref, out, tol, tol)
            normed = aggregate(sources, score_weight, EPS, norm_weight, NORM_EPS)
            ref_normed = naive.attn_res_aggregate(sources, score_weight, EPS, norm_weight, NORM_EPS)
            assert_close(f"{name} {dtype} + rms_norm", ref_normed, normed, 2 * tol, 2 * tol)
            if sources.shape[0] == 1:
                assert torch.equal(out, sources[0])
