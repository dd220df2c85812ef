"""The sigmoid gate: x * sigmoid(gate) in fp32, rounded once into the output dtype; shapes checked at the edge."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels.gate import sigmoid_gate

from _close import assert_close


def test_gate_is_x_times_sigmoid_rounded_once() -> None:
    x, gate = torch.randn(3, 40), torch.randn(3, 40).bfloat16() * 4
    out = sigmoid_gate(x, gate, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (x.double() * torch.sigmoid(gate.double())).float().bfloat16())
    assert_close("default dtype", x * torch.sigmoid(gate.float()), sigmoid_gate(x, gate), 1e-6, 1e-6)


def test_gate_reads_a_column_slice() -> None:
    fused = torch.randn(4, 96)
    x = torch.randn(4, 32)
    assert torch.equal(sigmoid_gate(x, fused[:, 64:]), sigmoid_gate(x, fused[:, 64:].contiguous()))


def test_shape_errors_name_the_shapes() -> None:
    with pytest.raises(ValueError, match="must match"):
        sigmoid_gate(torch.randn(2, 8), torch.randn(2, 4))
    with pytest.raises(ValueError, match="floating"):
        sigmoid_gate(torch.randn(2, 8), torch.ones(2, 8, dtype=torch.int64))
