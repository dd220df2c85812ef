"""linear: x @ weight^T as F.linear computes it (bit for bit: the model's CPU path), an fp32 result from 16-bit
inputs without any 16-bit rounding, shapes and dtypes checked at the edge, the reference on the CPU. The
Triton kernel runs under the interpreter in test_linear_triton_interpret.py, on the device in
test_linear_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3serve.kernels import linear as linear_op
from k3serve.kernels.linear import linear

from _close import assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_linear_is_f_linear_bit_for_bit(dtype: torch.dtype) -> None:
    x, w = torch.randn(2, 3, 96).to(dtype), torch.randn(40, 96).to(dtype)
    out = linear(x, w)
    assert out.dtype == dtype and out.shape == (2, 3, 40)
    assert torch.equal(out, F.linear(x, w))
    assert torch.equal(linear(x, w, out_dtype=dtype), out)
    assert linear_op.last_backend["linear"] == "naive"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_out_sums_the_exact_products_in_fp32(dtype: torch.dtype) -> None:
    """The router's logits: no rounding to 16 bits anywhere, so the result is the fp64 one up to fp32 sums."""
    x, w = torch.randn(5, 512).to(dtype), torch.randn(70, 512).to(dtype)
    out = linear(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (5, 70)
    exact = x.double() @ w.double().t()
    assert_close("fp32 out", exact, out.double(), 1e-5, 1e-5)
    rounded = linear(x, w).double()
    assert (rounded - exact).abs().max() > 100 * (out.double() - exact).abs().max()  # far more than fp32 sums


@pytest.mark.parametrize("add_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_joins_the_fp32_sums_before_the_one_rounding(add_dtype: torch.dtype) -> None:
    """The shared experts' sum added to the up-projection: (exact products summed in fp32 + add) rounded once,
    closer to the exact result than rounding the product first and adding after."""
    x, w = torch.randn(3, 2, 512).bfloat16(), torch.randn(70, 512).bfloat16()
    add = (16 * torch.randn(3, 2, 70)).to(add_dtype)
    out = linear(x, w, add=add)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 2, 70)
    exact = x.double() @ w.double().t() + add.double()
    assert_close("bf16 out + add", exact, out.double(), 1e-3, 2**-8)  # one bf16 rounding of the exact value
    assert torch.equal(linear(x, w, torch.float32, add), (linear(x, w, torch.float32) + add.float()))
    with pytest.raises(ValueError, match="add must be"):
        linear(x, w, add=torch.randn(3, 2, 71))


def test_empty_and_single_row_inputs_keep_their_shape() -> None:
    w = torch.randn(8, 16)
    assert linear(torch.randn(0, 16), w).shape == (0, 8)
    assert linear(torch.randn(16), w).shape == (8,)


@pytest.mark.parametrize(
    ("x", "w", "out_dtype", "message"),
    [
        (torch.randn(4, 16), torch.randn(8, 12), None, "same K"),
        (torch.randn(4, 16), torch.randn(2, 8, 16), None, "weight \\[N, K\\]"),
        (torch.randn(4, 16), torch.randn(8, 16).bfloat16(), None, "one floating dtype"),
        (torch.randint(0, 3, (4, 16)), torch.randint(0, 3, (8, 16)), None, "one floating dtype"),
        (torch.randn(4, 16), torch.randn(8, 16), torch.bfloat16, "out_dtype"),
        (torch.randn(4, 16).half(), torch.randn(8, 16).half(), torch.bfloat16, "out_dtype"),
    ],
    ids=["K mismatch", "3-d weight", "mixed dtypes", "integers", "fp32 to bf16", "fp16 to bf16"],
)
def test_bad_arguments_are_rejected_by_name(x, w, out_dtype, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        linear(x, w, out_dtype)
