"""MoE routing (sigmoid scores, correction-biased top-k, gather, renormalize, scale) as one Triton launch;
the torch reference takes ~10. One program routes one token: it holds the row of E scores in registers
and takes the k largest by repeated arg-max, so the ids come out in the reference's order (descending
biased score, ties to the lower expert id, see `naive.select_experts`). The sigmoid is torch's formula
with IEEE exp and division (not Triton's approximate ones), so the scores, and therefore the ids, equal
the reference's on CUDA bit for bit.

Non-finite biased scores keep the reference's order too: the compiled arg-max's comparisons drop NaN
(and a taken -inf would be taken again), so NaN ranks as +inf, above every number, as in torch's descending
sort, and -inf as the lowest finite float; ids stay distinct and in [0, E), weights of NaN scores stay NaN."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from torch import Tensor

from .._backend import device_of

_LOWEST = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX: below every finite score, above a taken lane
MAX_EXPERTS, MAX_TOP_K = 1024, 32  # one row of scores in one program's registers (K3: 896 experts, top 16)


def supports(router_logits: Tensor, top_k: int) -> bool:
    return router_logits.shape[1] <= MAX_EXPERTS and top_k <= MAX_TOP_K


@triton.jit
def _router_kernel(logits, bias, weights_out, ids_out, E, stride_l, scaling, TOP_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    x = tl.load(logits + tok * stride_l + offs, mask=ok, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:  # CUDA's expf, which torch.sigmoid uses (tl.exp is an approximation there)
        e = libdevice.exp(-x)
    else:  # the interpreter, which has no libdevice: numpy's exp
        e = tl.exp(-x)
    scores = tl.math.div_rn(1.0, 1.0 + e)  # torch.sigmoid's formula, with its IEEE division
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias + offs, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(choice != choice, float("inf"), tl.maximum(choice, _LOWEST))  # the sort's order, no NaN
    choice = tl.where(ok, choice, -float("inf"))  # taken and padding lanes lose to every expert left
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0, tie_break_left=True)
        picked = offs == best
        weights = tl.where(slots == j, tl.sum(tl.where(picked, scores, 0.0), axis=0), weights)
        ids = tl.where(slots == j, best.to(tl.int64), ids)
        choice = tl.where(picked, -float("inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    out = tok * TOP_K + slots
    tl.store(weights_out + out, weights * scaling, mask=slots < TOP_K)
    tl.store(ids_out + out, ids, mask=slots < TOP_K)


def select_experts(router_logits: Tensor, correction_bias: Tensor | None, top_k: int, renormalize: bool,
                   scaling_factor: float) -> tuple[Tensor, Tensor]:
    T, E = router_logits.shape
    weights = torch.empty((T, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=router_logits.device)
    if T == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    bias = correction_bias.contiguous() if correction_bias is not None else logits
    with device_of(logits):
        _router_kernel[(T,)](
            logits, bias, weights, ids, E, logits.stride(0), scaling_factor, TOP_K=top_k,
            HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize, LIBDEVICE_EXP=logits.is_cuda,
            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
        )
    return weights, ids
