"""The norms on the GPU run the Triton kernel (one launch each) and match the torch reference at K3's
shapes; see `_norm_cases.py`."""

from __future__ import annotations

import pytest

from k3serve.kernels import norm
from k3serve.kernels.norm import gated_rms_norm, l2_normalize, rms_norm

from _norm_cases import check_norms_match_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 64, 1000])
def test_triton_norms_match_reference(rows: int) -> None:
    norm.last_backend.clear()
    check_norms_match_reference((rms_norm, gated_rms_norm, l2_normalize), "cuda", rows)
    assert norm.last_backend == {"rms_norm": "triton", "gated_rms_norm": "triton", "l2_normalize": "triton"}
