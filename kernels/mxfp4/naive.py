"""Plain-torch OCP MXFP4 (E2M1 elements, E8M0 scale per 32) in the compressed-tensors
`mxfp4-pack-quantized` layout: `packed uint8 [..., out, in/2]` (even element in the low nibble),
`scales uint8 [..., out, in/32]` (value 2^(s-127)). All math is fp32 and exact."""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32
E8M0_BIAS = 127
E2M1_MAX = 6.0
# Magnitudes of codes 0..7; bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes. RTNE sends a tie to the code with an even mantissa bit
# (even code): ties at these go DOWN (lower code 0/2/4/6 is even) ...
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
# ... and ties at these go UP (upper code 2/4/6 is even).
_TIES_UP = (0.75, 1.75, 3.5)


def _e2m1_lut(device: torch.device) -> Tensor:
    """Value of each of the 16 codes, [16] fp32 (codes 8..15 are the negatives, 8 = -0)."""
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mag, -mag])


def _e8m0_to_fp32(scales: Tensor) -> Tensor:
    """2^(s-127) exactly (s=0 gives the fp32 subnormal 2^-127); [...] uint8 -> fp32."""
    return torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.to(torch.int32) - E8M0_BIAS)


def dequantize_mxfp4(packed: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """[..., out, in/2] uint8 + [..., out, in/32] uint8 -> [..., out, in] `dtype`."""
    low = (packed & 0x0F).long()
    high = (packed >> 4).long()
    codes = torch.stack([low, high], dim=-1).flatten(-2)  # [..., out, in], element 2i = low nibble
    values = _e2m1_lut(packed.device)[codes]
    blocks = values.unflatten(-1, (-1, BLOCK)) * _e8m0_to_fp32(scales).unsqueeze(-1)  # [..., out, in/32, 32]
    return blocks.flatten(-2).to(dtype)


def _round_to_e2m1(magnitude: Tensor) -> Tensor:
    """|x|/scale (fp32, >= 0) -> code 0..7, round-to-nearest-even, saturating at 6 (code 7)."""
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for mid in _TIES_DOWN:
        code += (magnitude > mid).to(torch.uint8)
    for mid in _TIES_UP:
        code += (magnitude >= mid).to(torch.uint8)
    return code


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """[..., out, in] -> (packed [..., out, in/2], scales [..., out, in/32]), OCP round-down scale.

    The scale is 2^(floor(log2(amax)) - 2) (emax of E2M1 is 2), so amax/scale lies in [4, 8) and
    elements above 6·scale saturate; an all-zero block gets s = 0 (its codes are all 0)."""
    blocks = w.float().unflatten(-1, (-1, BLOCK))  # [..., out, in/32, 32]
    amax = blocks.abs().amax(dim=-1)  # [..., out, in/32]
    # frexp: amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1 (exact, no log rounding).
    _, exponent = torch.frexp(amax)
    biased = (exponent.to(torch.int32) - 1 - 2 + E8M0_BIAS).clamp(0, 254)
    biased = torch.where(amax > 0, biased, torch.zeros_like(biased))
    scales = biased.to(torch.uint8)
    magnitude = blocks.abs() / _e8m0_to_fp32(scales).unsqueeze(-1)  # exact: division by a power of two
    codes = _round_to_e2m1(magnitude) | (torch.signbit(blocks).to(torch.uint8) << 3)
    codes = codes.flatten(-2)  # [..., out, in]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scales
