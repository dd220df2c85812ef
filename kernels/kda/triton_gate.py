"""The KDA log-decay gate as one Triton launch (the torch reference takes ~7: cast, bias add, exp of A_log,
softplus or sigmoid, scales). Elementwise over the flattened [..., H, K] input, fp32 math and output.

softplus(x) = log1p(exp(x)) has no log1p in Triton, so it is computed as log(u) * e / (u - 1) with
e = exp(x), u = 1 + e (Goldberg's form: accurate also where e is below u's rounding step, where a plain
log(1 + e) would return 0), and x itself above torch's threshold of 20."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._backend import device_of

_BLOCK = 1024


@triton.jit
def _gate_kernel(f, A_log, dt_bias, out, N, HK, K, lower_bound, BOUNDED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    col = offs % HK  # position within one token's [H, K]
    x = tl.load(f + offs, mask=ok, other=0.0).to(tl.float32) + tl.load(dt_bias + col, mask=ok, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(A_log + col // K, mask=ok, other=0.0).to(tl.float32))  # one decay rate per head
    if BOUNDED:
        g = lower_bound / (1.0 + tl.exp(-(a * x)))
    else:
        e = tl.exp(x)
        u = 1.0 + e
        softplus = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
        g = -a * tl.where(x > 20.0, x, softplus)
    tl.store(out + offs, g, mask=ok)


def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None = None) -> Tensor:
    H, K = f.shape[-2:]
    f = f.contiguous()
    out = torch.empty(f.shape, dtype=torch.float32, device=f.device)
    if f.numel() == 0:
        return out
    with device_of(f):
        _gate_kernel[(triton.cdiv(f.numel(), _BLOCK),)](
            f, A_log.contiguous(), dt_bias.contiguous(), out, f.numel(), H * K, K,
            0.0 if lower_bound is None else lower_bound, BOUNDED=lower_bound is not None, BLOCK=_BLOCK, num_warps=4,
        )
    return out
