"""Norms: fp32 math whatever the input dtype, one rounding at the output, shapes checked at the edge."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels.norm import gated_rms_norm, l2_normalize, rms_norm

from _close import assert_close

EPS = 1e-6


def _rms_norm_fp64(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.double()
    y = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return y if weight is None else y * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_matches_formula(dtype: torch.dtype) -> None:
    x = (torch.randn(5, 7, 96) * 3).to(dtype)
    w = torch.randn(96)
    out = rms_norm(x, w, EPS)
    assert out.dtype == dtype
    # bf16: the only error allowed is the single rounding of the result
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert_close("rms_norm", _rms_norm_fp64(x, w, EPS).to(dtype).double(), out.double(), tol, tol)


def test_rms_norm_without_weight_is_unit_scale() -> None:
    x = torch.randn(4, 96)
    assert_close("no weight", rms_norm(x, torch.ones(96), EPS), rms_norm(x, None, EPS), 0, 0)
    assert_close("unit rms", torch.ones(4), rms_norm(x, None, 0.0).pow(2).mean(-1), 1e-5, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_rms_norm_is_rms_norm_times_sigmoid_gate(dtype: torch.dtype) -> None:
    x, gate = torch.randn(6, 3, 32).to(dtype), torch.randn(6, 3, 32).to(dtype)
    w = torch.randn(32)
    ref = (_rms_norm_fp64(x, w, EPS) * torch.sigmoid(gate.double())).to(dtype)
    out = gated_rms_norm(x, gate, w, EPS)
    assert out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert_close("gated_rms_norm", ref.double(), out.double(), tol, tol)


def test_l2_normalize_gives_unit_rows_and_keeps_zero_rows_finite() -> None:
    x = torch.randn(10, 3, 16) * 5
    x[0, 0] = 0.0
    out = l2_normalize(x)
    assert_close("l2 formula", x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt(), out, 1e-7, 1e-6)
    assert_close("unit norm", torch.ones(9, 3), out[1:].norm(dim=-1), 1e-5, 0)
    assert torch.equal(out[0, 0], torch.zeros(16))
    assert l2_normalize(x.bfloat16()).dtype == torch.bfloat16


def test_shape_errors_name_the_expected_shape() -> None:
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"weight must be \[D=32\]"):
        rms_norm(x, torch.ones(16), EPS)
    with pytest.raises(ValueError, match="gate must match x"):
        gated_rms_norm(x, torch.randn(4, 16), torch.ones(32), EPS)
    with pytest.raises(ValueError, match="floating"):
        l2_normalize(torch.ones(4, 32, dtype=torch.int64))


def test_rms_norm_out_dtype_rounds_once() -> None:
    """An fp32 input normalized straight into bf16 equals normalizing in fp32 and casting after."""
    x, w = torch.randn(4, 96) * 3, torch.randn(96).bfloat16()
    out = rms_norm(x, w, EPS, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, rms_norm(x, w, EPS).bfloat16())


def test_rms_norm_out_is_written_in_place_and_checked() -> None:
    """out= normalizes into a given buffer (MLA's latent inside its projection row) and is what returns; an out of
    another shape, a strided last dim or a dtype other than out_dtype is refused by name."""
    x, w = torch.randn(4, 96), torch.randn(96)
    row = torch.randn(4, 160)
    c = row[:, :96]
    c.copy_(x)
    got = rms_norm(c, w, EPS, out=c)
    assert got.data_ptr() == c.data_ptr() and torch.equal(got, rms_norm(x, w, EPS))
    assert torch.equal(row[:, :96], rms_norm(x, w, EPS))
    with pytest.raises(ValueError, match="out must be"):
        rms_norm(x, w, EPS, out=torch.empty(4, 95))
    with pytest.raises(ValueError, match="out must be"):
        rms_norm(x, w, EPS, out=torch.empty(96, 4).t())
    with pytest.raises(ValueError, match="differs from out's dtype"):
        rms_norm(x, w, EPS, out_dtype=torch.bfloat16, out=torch.empty(4, 96))
