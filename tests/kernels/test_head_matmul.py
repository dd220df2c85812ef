"""Per-head products with an fp32 result: 16-bit operands' exact products summed in fp32 (never rounded to
16 bits); the shapes and dtypes checked at the edge. The cuBLAS module's view plumbing (x read as [H, N, K],
the result written through a view of a contiguous [N, H, M]) runs here on fp32 CPU tensors too."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels.head_matmul import cublas, head_matmul

from _close import assert_close


def _fp64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("nhk,hkm->nhm", x.double(), w.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_products_are_summed_in_fp32(dtype: torch.dtype) -> None:
    q = torch.randn(3, 4, 48).to(dtype)[:, :, :32]  # q_nope: a slice of wider q rows, as MLA's
    w = torch.randn(4, 32, 64).to(dtype)
    out = head_matmul(q, w)
    assert out.dtype == torch.float32 and out.shape == (3, 4, 64) and out.is_contiguous()
    assert_close("fp32 sums", _fp64(q, w), out, 1e-5, 1e-5)  # bf16 rounding would be ~1e-2 off


def test_cublas_views_give_the_reference_on_fp32() -> None:
    x = torch.randn(5, 4, 40)[:, :, 8:]
    w_t = torch.randn(4, 16, 32).transpose(1, 2)  # MLA's W_UV [H, v, L] read as [H, L, v]
    out = cublas.head_matmul(x, w_t)
    assert out.is_contiguous()
    assert_close("cublas plumbing", _fp64(x, w_t), out, 1e-5, 1e-5)


def test_errors_name_the_expected_shapes_and_dtypes() -> None:
    with pytest.raises(ValueError, match=r"x must be \[N, H, K\] and w \[H, K, M\]"):
        head_matmul(torch.randn(2, 4, 8), torch.randn(4, 16, 8))
    with pytest.raises(ValueError, match="share one floating dtype"):
        head_matmul(torch.randn(2, 4, 8).bfloat16(), torch.randn(4, 8, 16))
