"""OCP MXFP4 weights as stored by compressed-tensors `mxfp4-pack-quantized` (K3 routed experts).

Layout of one [out, in] weight (leading dims, e.g. experts, are carried along):

    packed  uint8 [out, in/2]    byte j of a row = code[2j] | code[2j+1] << 4   (E2M1, bit 3 = sign)
    scales  uint8 [out, in/32]   E8M0, value 2^(s-127), one per 32 contiguous `in` elements

0xFF (the E8M0 NaN) is never produced by `quantize_mxfp4` and is rejected by `dequantize_mxfp4`:
a checkpoint holding it is corrupt, and propagating NaN through an expert would hide that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import naive

__all__ = ["MXFP4Tensor", "quantize_mxfp4", "dequantize_mxfp4"]

BLOCK = naive.BLOCK


def _check_pair(packed: Tensor, scales: Tensor) -> None:
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if packed.dim() < 2 or packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] != scales.shape[-1] * BLOCK // 2:
        raise ValueError(
            f"packed [..., out, in/2] and scales [..., out, in/32] disagree: "
            f"packed {tuple(packed.shape)}, scales {tuple(scales.shape)}"
        )


@dataclass(frozen=True)
class MXFP4Tensor:
    """A weight [..., out, in] kept packed; dequantized only where a reference op needs it."""

    packed: Tensor  # uint8 [..., out, in/2], even element in the low nibble
    scales: Tensor  # uint8 [..., out, in/32], E8M0 (2^(s-127))

    def __post_init__(self) -> None:
        _check_pair(self.packed, self.scales)

    @property
    def shape(self) -> torch.Size:
        """Logical shape [..., out, in]."""
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * 2))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_mxfp4(self.packed, self.scales, dtype)

    def narrow_rows(self, start: int, length: int) -> MXFP4Tensor:
        """Rows [start, start+length) of the `out` dim: a tensor-parallel shard of a column-parallel weight."""
        out = self.packed.shape[-2]
        if start < 0 or length < 0 or start + length > out:
            raise ValueError(f"narrow_rows({start}, {length}) is outside out={out} of shape {tuple(self.shape)}")
        return MXFP4Tensor(self.packed.narrow(-2, start, length), self.scales.narrow(-2, start, length))


def quantize_mxfp4(w: Tensor) -> MXFP4Tensor:
    """w [..., out, in] (float, finite, in % 32 == 0) -> MXFP4Tensor.

    OCP round-down scale 2^(floor(log2 amax) - 2) per 32, elements RTNE to E2M1, saturating at ±6·scale."""
    if not w.is_floating_point() or w.dim() < 2 or w.shape[-1] % BLOCK != 0:
        raise ValueError(
            f"w must be a float tensor [..., out, in] with in % {BLOCK} == 0, got {w.dtype} {tuple(w.shape)}"
        )
    if not torch.isfinite(w).all():
        raise ValueError("w holds inf or NaN, which MXFP4 cannot represent")
    return MXFP4Tensor(*naive.quantize_mxfp4(w))


def dequantize_mxfp4(packed: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """packed uint8 [..., out, in/2], scales uint8 [..., out, in/32] -> [..., out, in] `dtype` (exact in fp32)."""
    _check_pair(packed, scales)
    if (scales == 0xFF).any():
        raise ValueError("scales holds 0xFF (E8M0 NaN); the checkpoint is corrupt")
    return naive.dequantize_mxfp4(packed, scales, dtype)
