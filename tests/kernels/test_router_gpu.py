"""MoE routing on the GPU runs the Triton router (one launch) and picks the reference's experts in the
reference's order at K3's shapes; see `_router_cases.py`."""

from __future__ import annotations

import pytest

from k3serve.kernels import moe
from k3serve.kernels.moe import select_experts

from _router_cases import check_router_matches_reference, check_router_orders_non_finite_scores_as_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 64, 1000])
def test_triton_router_matches_reference(rows: int) -> None:
    moe.last_backend.clear()
    check_router_matches_reference(select_experts, "cuda", rows)
    assert moe.last_backend == {"select_experts": "triton"}


def test_triton_router_orders_non_finite_scores_as_reference() -> None:
    moe.last_backend.clear()
    check_router_orders_non_finite_scores_as_reference(select_experts, "cuda")
    assert moe.last_backend == {"select_experts": "triton"}
