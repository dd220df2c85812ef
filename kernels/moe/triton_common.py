"""Triton helpers shared by the routed-expert kernels of `triton_moe.py` (tensor cores) and `triton_gemv.py`
(CUDA cores), so neither imports the other's module for them."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):  # as 2 * sigmoid(2x) - 1: SiTU's caps in the fused GLU epilogues
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0
