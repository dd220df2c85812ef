"""The KDA gate on the GPU runs the Triton kernel (one launch) and matches the torch reference at K3's shapes;
see `_kda_gate_cases.py`."""

from __future__ import annotations

import pytest

from k3serve.kernels import kda
from k3serve.kernels.kda import kda_gate

from _kda_gate_cases import check_kda_gate_matches_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 64, 1000])
def test_triton_kda_gate_matches_reference(rows: int) -> None:
    kda.last_backend.clear()
    check_kda_gate_matches_reference(kda_gate, "cuda", rows)
    assert kda.last_backend == {"kda_gate": "triton"}
