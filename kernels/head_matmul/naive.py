"""Plain-torch per-head products: both operands widened to fp32, one fp32 einsum, laid out [N, H, M]."""

from __future__ import annotations

import torch
from torch import Tensor


def head_matmul(x: Tensor, w: Tensor) -> Tensor:
    return torch.einsum("nhk,hkm->nhm", x.float(), w.float()).contiguous()
