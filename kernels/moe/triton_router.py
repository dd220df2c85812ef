"""MoE routing (sigmoid scores, correction-biased top-k, gather, renormalize, scale) as one Triton launch;
the torch reference takes ~10. One program routes one token: it holds the row of E scores in registers
and takes the k largest by repeated max over one int64 key a lane, (the score's bits in an order-keeping
integer form) << 32 | (BLOCK_E - 1 - id): one reduction a pick, whose winner is the highest score and, among
equal scores, the lower expert id, the reference's order (`naive.select_experts`). A warp or two hold the row,
so a pick is shuffles within warps, not a round trip through shared memory (a two-value arg-max over four
warps was slower: docs/BENCHMARKS.md). The weights are the picked experts' scores, recomputed
from their logits after the picks. The sigmoid is torch's formula with IEEE exp and division (not Triton's
approximate ones), so the scores, and therefore the ids, equal the reference's on CUDA bit for bit.

Non-finite biased scores keep the reference's order too: NaN ranks as +inf, above every number, as in
torch's descending sort, and -inf as the lowest finite float; ids stay distinct and in [0, E), weights of
NaN scores stay NaN."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from torch import Tensor

from .._backend import device_of

_LOWEST = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX: below every finite score
_NO_KEY = tl.constexpr(-(2**63))  # a taken or padding lane: below every expert's key
MAX_EXPERTS, MAX_TOP_K = 1024, 32  # one row of scores in one program's registers (K3: 896 experts, top 16)
NUM_WARPS = 2  # 1024 keys: 16 a thread


def supports(router_logits: Tensor, top_k: int) -> bool:
    return router_logits.shape[1] <= MAX_EXPERTS and top_k <= MAX_TOP_K


@triton.jit
def _sigmoid(logits, LIBDEVICE_EXP: tl.constexpr):
    """torch.sigmoid of loaded logits (values, any float dtype), bit for bit: 1 / (1 + exp(-x)) in fp32 with
    IEEE exp and division."""
    x = logits.to(tl.float32)
    if LIBDEVICE_EXP:  # CUDA's expf, which torch.sigmoid uses (tl.exp is an approximation there)
        e = libdevice.exp(-x)
    else:  # the interpreter, which has no libdevice: numpy's exp
        e = tl.exp(-x)
    return tl.math.div_rn(1.0, 1.0 + e)


@triton.jit
def _router_kernel(logits, bias, weights_out, ids_out, E, stride_l, scaling, TOP_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    choice = _sigmoid(tl.load(logits + tok * stride_l + offs, mask=ok, other=0.0), LIBDEVICE_EXP)
    if HAS_BIAS:
        choice = choice + tl.load(bias + offs, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(choice != choice, float("inf"), tl.maximum(choice, _LOWEST)) + 0.0  # no NaN, no -0.0
    bits = choice.to(tl.int32, bitcast=True)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)  # signed-int order == float order
    key = tl.where(ok, (ordered << 32) | (BLOCK_E - 1 - offs), _NO_KEY)  # padding lanes lose to every expert
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        ids = tl.where(slots == j, BLOCK_E - 1 - (best & 0xFFFFFFFF), ids)
        key = tl.where(key == best, _NO_KEY, key)  # keys are distinct (the id is in them): one lane is taken
    picked = slots < TOP_K
    weights = _sigmoid(tl.load(logits + tok * stride_l + ids, mask=picked, other=0.0), LIBDEVICE_EXP)
    weights = tl.where(picked, weights, 0.0)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    out = tok * TOP_K + slots
    tl.store(weights_out + out, weights * scaling, mask=picked)
    tl.store(ids_out + out, ids, mask=picked)


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
            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k), num_warps=NUM_WARPS,
        )
    return weights, ids
