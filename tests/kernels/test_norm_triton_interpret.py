"""The CUDA path's Triton norm kernel, run by the Triton interpreter on CPU tensors, matches the torch
reference on the cases of `_norm_cases.py` (test_norm_gpu.py checks the same cases on the device). The
kernel only loads, casts and stores bf16 (its math is fp32), which the interpreter does exactly."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _kernel_matches_reference() -> None:
    from k3serve.kernels.norm import triton_norm

    from _norm_cases import check_norms_match_reference

    check_norms_match_reference((triton_norm.rms_norm, triton_norm.gated_rms_norm, triton_norm.l2_normalize), "cpu", 3)


def test_triton_norms_match_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_kernel_matches_reference")
