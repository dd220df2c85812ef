"""The GLUs on the GPU run the Triton kernel (one launch each) and match the torch reference at K3's shapes;
see `_glu_cases.py`."""

from __future__ import annotations

import pytest

from k3serve.kernels import moe
from k3serve.kernels.moe import silu_glu, situ_glu

from _glu_cases import check_glu_matches_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 64, 1000])
def test_triton_glu_matches_reference(rows: int) -> None:
    moe.last_backend.clear()
    check_glu_matches_reference(situ_glu, silu_glu, "cuda", rows)
    assert moe.last_backend == {"situ_glu": "triton", "silu_glu": "triton"}
