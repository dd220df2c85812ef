"""The CUDA path's attention-residual kernel, run by the Triton interpreter on CPU tensors, matches the torch
reference on the cases of `_attn_res_cases.py` (test_attn_res_gpu.py checks the same cases on the device).
The kernel only loads, casts and stores bf16 (its math is fp32), which the interpreter does exactly."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _kernel_matches_reference() -> None:
    from k3serve.kernels.attn_res import triton_attn_res

    from _attn_res_cases import check_attn_res_matches_reference

    check_attn_res_matches_reference(triton_attn_res.attn_res_aggregate, "cpu", 3, exact_rounding=False)


def test_triton_attn_res_matches_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_kernel_matches_reference")
