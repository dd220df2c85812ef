"""Plain-torch sigmoid gate: fp32 math, one rounding at the output."""

from __future__ import annotations

import torch
from torch import Tensor


def sigmoid_gate(x: Tensor, gate: Tensor, out_dtype: torch.dtype) -> Tensor:
    return (x.float() * torch.sigmoid(gate.float())).to(out_dtype)
