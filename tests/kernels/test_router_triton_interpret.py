"""The CUDA path's router kernel, run by the Triton interpreter on CPU tensors, picks the same experts in the
same order as the torch reference, with the same weights, on the cases of `_router_cases.py`
(test_router_gpu.py checks the same cases on the device). The kernel ranks integer keys, so the
interpreter's numpy max makes the compiled kernel's comparisons."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _kernel_matches_reference() -> None:
    from k3serve.kernels.moe import triton_router

    from _router_cases import check_router_matches_reference

    check_router_matches_reference(triton_router.select_experts, "cpu", 4)


def test_triton_router_matches_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_kernel_matches_reference")


def _kernel_orders_non_finite_scores_as_reference() -> None:
    from k3serve.kernels.moe import triton_router

    from _router_cases import check_router_orders_non_finite_scores_as_reference

    check_router_orders_non_finite_scores_as_reference(triton_router.select_experts, "cpu")


def test_triton_router_orders_non_finite_scores_as_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_kernel_orders_non_finite_scores_as_reference")
