"""The CUDA path's GLU kernel, run by the Triton interpreter on CPU tensors, matches the torch reference on the
cases of `_glu_cases.py` (test_glu_gpu.py checks the same cases on the device)."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _kernel_matches_reference() -> None:
    from functools import partial

    from k3serve.kernels.moe import triton_glu

    from _glu_cases import check_glu_matches_reference

    def situ(gate, up, beta, linear_beta):
        return triton_glu.glu(gate, up, True, beta, linear_beta)

    check_glu_matches_reference(situ, partial(triton_glu.glu, situ=False), "cpu", 3)


def test_triton_glu_matches_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_kernel_matches_reference")
