"""The CUDA path's router kernel, run by the Triton interpreter on CPU tensors, picks the same experts in the
same order as the torch reference, with the same weights, on the cases of `_router_cases.py`
(test_router_gpu.py checks the same cases on the device).

The interpreter's tl.argmax is numpy's, which ranks NaN first by itself; the non-finite cases run the
arg-max through Triton's combine function instead (`_argmax_as_compiled`), the comparisons the compiled
kernel makes, under which a NaN loses every comparison it sits on the left of."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _kernel_matches_reference() -> None:
    from k3serve.kernels.moe import triton_router

    from _router_cases import check_router_matches_reference

    check_router_matches_reference(triton_router.select_experts, "cpu", 4)


def test_triton_router_matches_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_kernel_matches_reference")


def _argmax_as_compiled() -> None:
    """Reduce tl.argmax with triton's own combine (its generic reduction) in place of numpy's argmax."""
    import triton.language as tl
    from triton.runtime import interpreter

    apply_impl = interpreter.ReduceOps.apply_impl

    def combine_as_compiled(self, input):
        if self.combine_fn == tl.standard._argmax_combine_tie_break_left:
            return self.generic_reduce(input)
        return apply_impl(self, input)

    interpreter.ReduceOps.apply_impl = combine_as_compiled


def _kernel_orders_non_finite_scores_as_reference() -> None:
    from k3serve.kernels.moe import triton_router

    from _router_cases import check_router_orders_non_finite_scores_as_reference

    _argmax_as_compiled()
    check_router_orders_non_finite_scores_as_reference(triton_router.select_experts, "cpu")


def test_triton_router_orders_non_finite_scores_as_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_kernel_orders_non_finite_scores_as_reference")
