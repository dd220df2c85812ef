"""The attention-residual cases that the Triton kernel must match the torch reference on, shared by the GPU
test and the CPU test under the Triton interpreter: K3's shape (hidden 7168, bank + prefix = 2 sources),
a longer bank of sources at very different scales (a saturated softmax), one source, a hidden size that
is not a power of two, the leading rows of a larger bank (as the model passes `sources[:k + 1]`), sources
strided along D, no tokens; each plain, with the fused RMSNorm, and with the prefix update too, in bf16
and fp32."""

from __future__ import annotations

from typing import Callable

import torch

from k3serve.kernels.attn_res import naive

from _close import assert_close

EPS, NORM_EPS = 1e-6, 1e-5


def _cases(rows: int, device: str):
    """(name, bank, S): the sources are bank[:S], so an in-place prefix update lands inside the bank."""
    scales = torch.tensor([0.01, 1.0, 30.0, 2.0, 0.5], device=device).reshape(5, 1, 1)
    yield "K3 bank + prefix", torch.randn(2, rows, 7168, device=device) * torch.tensor([1.0, 3.0], device=device)[:, None, None], 2
    yield "five sources, scales 0.01..30", torch.randn(5, rows, 96, device=device) * scales, 5
    yield "one source", torch.randn(1, rows, 7168, device=device), 1
    yield "hidden 40", torch.randn(3, rows, 40, device=device), 3
    yield "rows 0..3 of a bank of 6", torch.randn(6, rows, 96, device=device), 4
    yield "strided along D", torch.randn(3, rows, 192, device=device)[..., ::2], 3
    yield "no tokens", torch.randn(3, 0, 96, device=device), 3


def check_attn_res_matches_reference(aggregate: Callable, device: str, rows: int, exact_rounding: bool) -> None:
    """Every case within one output rounding of `naive.py` (the fp32 sum orders differ); one source comes
    back bit-exactly. The updated prefix row is one rounding of an fp32 sum: equal to the bit where the
    kernel rounds to nearest as torch does (exact_rounding: on the GPU; the interpreter rounds fp32 to
    bf16 toward zero, one bf16 ulp off)."""
    for dtype, tol in ((torch.bfloat16, 8e-3), (torch.float32, 2e-5)):
        for name, bank, S in _cases(rows, device):
            bank = bank.to(dtype)
            sources, (T, D) = bank[:S], bank.shape[1:]
            score_weight = torch.randn(D, device=device) / D**0.5
            norm_weight = (1 + 0.1 * torch.randn(D, device=device)).to(dtype)
            ref = naive.attn_res_aggregate(sources, score_weight, EPS)
            out = aggregate(sources, score_weight, EPS)
            assert out.dtype == dtype and out.is_contiguous()
            assert_close(f"{name} {dtype}", ref, out, tol, tol)
            if S == 1:
                assert torch.equal(out, sources[0])
            normed = aggregate(sources, score_weight, EPS, norm_weight, NORM_EPS)
            ref_normed = naive.attn_res_aggregate(sources, score_weight, EPS, norm_weight, NORM_EPS)
            assert_close(f"{name} {dtype} + rms_norm", ref_normed, normed, 2 * tol, 2 * tol)

            delta = torch.randn(T, D, device=device).to(dtype)
            ref_bank, out_bank = bank.clone(), bank.clone()
            ref_normed = naive.attn_res_aggregate(ref_bank[:S], score_weight, EPS, norm_weight, NORM_EPS, delta)
            normed = aggregate(out_bank[:S], score_weight, EPS, norm_weight, NORM_EPS, delta)
            update_tol = 0 if exact_rounding or dtype == torch.float32 else tol
            assert_close(f"{name} {dtype} prefix update", ref_bank, out_bank, update_tol, update_tol)
            assert not torch.equal(out_bank[S - 1], bank[S - 1]) or T == 0
            assert_close(f"{name} {dtype} prefix update + rms_norm", ref_normed, normed, 2 * tol, 2 * tol)
