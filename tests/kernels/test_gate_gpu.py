"""The sigmoid gate on the GPU runs the Triton kernel (one launch) and matches the torch reference at K3's
shapes; see `_gate_cases.py`."""

from __future__ import annotations

import pytest

from k3serve.kernels import gate
from k3serve.kernels.gate import sigmoid_gate

from _gate_cases import check_gate_matches_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 64, 1000])
def test_triton_gate_matches_reference(rows: int) -> None:
    gate.last_backend.clear()
    check_gate_matches_reference(sigmoid_gate, "cuda", rows)
    assert gate.last_backend == {"sigmoid_gate": "triton"}
