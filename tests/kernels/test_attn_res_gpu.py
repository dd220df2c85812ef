"""The attention-residual mix on the GPU runs the Triton kernel (one launch, with or without the fused
RMSNorm) and matches the torch reference at K3's shapes; see `_attn_res_cases.py`."""

from __future__ import annotations

import pytest

from k3serve.kernels import attn_res
from k3serve.kernels.attn_res import attn_res_aggregate

from _attn_res_cases import check_attn_res_matches_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 64, 1000])
def test_triton_attn_res_matches_reference(rows: int) -> None:
    attn_res.last_backend.clear()
    check_attn_res_matches_reference(attn_res_aggregate, "cuda", rows, exact_rounding=True)
    assert attn_res.last_backend == {"attn_res_aggregate": "triton"}
