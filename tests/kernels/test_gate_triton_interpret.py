"""The CUDA path's sigmoid-gate kernel, run by the Triton interpreter on CPU tensors, matches the torch
reference on the cases of `_gate_cases.py` (test_gate_gpu.py checks the same cases on the device). The kernel
only loads, casts and stores bf16 (its math is fp32), which the interpreter does exactly."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _kernel_matches_reference() -> None:
    from k3serve.kernels.gate import triton_gate

    from _gate_cases import check_gate_matches_reference

    check_gate_matches_reference(triton_gate.sigmoid_gate, "cpu", 3)


def test_triton_gate_matches_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_kernel_matches_reference")
