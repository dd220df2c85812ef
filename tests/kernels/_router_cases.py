"""The routing cases that the Triton router must match the torch reference on, shared by the GPU test and the
CPU test under the Triton interpreter: K3's (896 experts, top 16, correction bias, renormalized, scaled),
the kernel's limits (1024 experts, top 32), a few experts, no bias without renormalizing, exact ties (every
logit repeated; saturated sigmoids; one flat row), bf16 logits, strided rows, no tokens. The ids must be
equal, in order (ties by ascending id); the weights within fp32 rounding (the renormalizing sum's order
differs)."""

from __future__ import annotations

from typing import Callable

import torch

from k3serve.kernels.moe import naive

from _close import assert_close


def _cases(rows: int, device: str):
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    yield "K3", randn(rows, 896) * 2, randn(896) * 0.1, 16, True, 2.446
    yield "1024 experts, top 32", randn(rows, 1024), randn(1024), 32, True, 1.0
    yield "6 experts, top 2, no bias", randn(rows, 6), None, 2, False, 1.0
    yield "every logit four times", randn(rows, 224).repeat(1, 4), randn(224).repeat(4), 16, True, 2.5
    yield "saturated sigmoids", randn(rows, 896).sign() * 40, None, 16, True, 1.0
    yield "one flat row", torch.zeros(rows, 896, device=device), torch.zeros(896, device=device), 16, False, 1.0
    yield "bf16 logits", randn(rows, 896).bfloat16(), randn(896) * 0.1, 16, True, 2.446
    yield "strided rows", randn(rows, 1000)[:, :896], randn(896) * 0.1, 16, True, 2.446
    yield "no tokens", randn(0, 896), randn(896), 16, True, 1.0


def check_router_matches_reference(select_experts: Callable, device: str, rows: int) -> None:
    for name, logits, bias, top_k, renormalize, scale in _cases(rows, device):
        ref_w, ref_ids = naive.select_experts(logits, bias, top_k, renormalize, scale)
        w, ids = select_experts(logits, bias, top_k, renormalize, scale)
        assert ids.dtype == torch.int64 and w.dtype == torch.float32, name
        assert torch.equal(ids, ref_ids), f"{name}: ids differ in {int((ids != ref_ids).any(1).sum())} rows"
        assert_close(f"{name} weights", ref_w, w, 1e-6, 1e-6)


def check_router_orders_non_finite_scores_as_reference(select_experts: Callable, device: str) -> None:
    """A NaN in a biased score (a NaN logit, a corrupt bias entry) ranks first, as in the reference's sort,
    and -inf last; the ids stay distinct and inside [0, E), NaN scores give NaN weights, never a guess."""
    logits, bias = torch.randn(4, 12, device=device), torch.randn(12, device=device) * 0.1
    bias[5] = float("nan")  # expert 5 ranks first in every row
    logits[1, 7] = float("nan")
    logits[2] = float("nan")  # a whole row: ids 0..k-1, as the stable sort gives
    bias[3] = bias[9] = -float("inf")  # last, in id order, each once
    for top_k, renormalize in ((4, False), (12, True)):
        ref_w, ref_ids = naive.select_experts(logits, bias, top_k, renormalize, 1.0)
        w, ids = select_experts(logits, bias, top_k, renormalize, 1.0)
        assert torch.equal(ids, ref_ids), f"top-{top_k}: ids {ids.tolist()}, reference {ref_ids.tolist()}"
        assert torch.equal(w.isnan(), ref_w.isnan()), f"top-{top_k}: NaN weights differ"
        assert_close(f"top-{top_k} weights", ref_w.nan_to_num(0.0), w.nan_to_num(0.0), 1e-6, 1e-6)
