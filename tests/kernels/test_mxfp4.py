"""MXFP4 reference: exact on-grid round trip, bounded off-grid error, nibble order, E8M0 NaN rejection."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels.mxfp4 import MXFP4Tensor, dequantize_mxfp4, quantize_mxfp4

from _close import assert_close

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _random_on_grid(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales whose every 32-block holds a ±4 or ±6, so the OCP scale is recovered."""
    *lead, out, inp = shape
    codes = torch.randint(0, 16, (*lead, out, inp), generator=gen, dtype=torch.uint8)
    codes[..., ::32] = torch.tensor([6, 7, 14, 15], dtype=torch.uint8)[
        torch.randint(0, 4, (*lead, out, inp // 32), generator=gen)
    ]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = torch.randint(1, 255, (*lead, out, inp // 32), generator=gen, dtype=torch.uint8)
    return packed, scales


@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96)], ids=lambda s: "x".join(map(str, s)))
def test_round_trip_exact_on_grid(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    packed, scales = _random_on_grid(shape, gen)
    w = dequantize_mxfp4(packed, scales)
    q = quantize_mxfp4(w)
    assert q.shape == w.shape
    assert torch.equal(q.scales, scales)
    assert torch.equal(q.packed, packed)  # -0 (code 8) survives too: the sign comes from signbit
    assert torch.equal(q.dequantize(), w)


def test_dequantize_values_exact() -> None:
    """Each code times 2^(s-127), including the fp32-subnormal end (s = 0) and the top (s = 254)."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # [32]
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 16)
    for s in (0, 1, 120, 127, 130, 254):
        w = dequantize_mxfp4(packed, torch.tensor([[s]], dtype=torch.uint8))
        expected = torch.cat([GRID, -GRID]).repeat(2) * (2.0 ** (s - 127))
        assert torch.equal(w[0], expected.float()), s


def test_off_grid_error_bound() -> None:
    """With scale 2^(floor(log2 amax) - 2), |x|/scale < 8. Bound per element (v = |x|/scale):
    |x - q| <= scale · step(v)/2 with step 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6];
    above 6 it saturates to exactly 6·scale (error < 2·scale)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(7, 256, generator=gen) * torch.logspace(-3, 3, 7)[:, None]
    q = quantize_mxfp4(w)
    deq = q.dequantize()
    scale = torch.ldexp(torch.ones(q.scales.shape), q.scales.int() - 127).repeat_interleave(32, dim=-1)
    v = w.abs() / scale
    assert (v < 8).all() and (v.amax(-1) >= 4).all()
    half_step = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))
    in_range = v <= 6
    assert ((w - deq).abs()[in_range] <= (half_step * scale)[in_range]).all()
    assert torch.equal(deq[~in_range], (torch.sign(w) * 6 * scale)[~in_range])


def test_rtne_ties() -> None:
    """Midpoints go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (scale 1)."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    w = torch.cat([torch.tensor([4.0]), ties, -ties, torch.zeros(17)]).reshape(1, 32)
    deq = quantize_mxfp4(w).dequantize()
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(deq[0, 1:8], expected) and torch.equal(deq[0, 8:15], -expected)


def test_packing_low_nibble_first() -> None:
    """Elements (1.0, -3.0) at scale 1: codes 2 and 8|5 = 13 -> byte 0xD2."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 1.0, -3.0, 4.0  # 4.0 fixes the scale at 2^(2-2) = 1
    q = quantize_mxfp4(w)
    assert q.packed[0, 0].item() == 0xD2 and q.packed[0, 1].item() == 0x06
    assert q.scales[0, 0].item() == 127


def test_zero_block_and_saturation() -> None:
    w = torch.zeros(2, 32)
    w[1, 0] = 7.9  # amax in [4, 8) at scale 1: saturates to 6
    q = quantize_mxfp4(w)
    assert q.scales[0, 0].item() == 0 and (q.packed[0] == 0).all()
    assert q.dequantize()[1, 0].item() == 6.0


def test_nan_scale_rejected() -> None:
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="0xFF"):
        dequantize_mxfp4(packed, torch.full((1, 1), 0xFF, dtype=torch.uint8))


def test_narrow_rows_and_validation() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 8, 64, generator=gen)
    q = quantize_mxfp4(w)
    shard = q.narrow_rows(2, 4)
    assert shard.shape == torch.Size([3, 4, 64])
    assert_close("narrow_rows", q.dequantize()[:, 2:6], shard.dequantize(), 0, 0)
    with pytest.raises(ValueError, match="narrow_rows"):
        q.narrow_rows(6, 4)
    with pytest.raises(ValueError, match="in % 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="disagree"):
        MXFP4Tensor(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


def test_bf16_output() -> None:
    gen = torch.Generator().manual_seed(3)
    packed, scales = _random_on_grid((4, 64), gen)
    scales = scales.clamp(100, 150)  # keep values inside bf16's normal range
    w32 = dequantize_mxfp4(packed, scales)
    assert torch.equal(dequantize_mxfp4(packed, scales, torch.bfloat16).float(), w32)  # <= 3 significant bits
