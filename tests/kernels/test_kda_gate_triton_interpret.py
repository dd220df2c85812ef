"""The CUDA path's KDA gate kernel, run by the Triton interpreter on CPU tensors, matches the torch reference
on the cases of `_kda_gate_cases.py` (test_kda_gate_gpu.py checks the same cases on the device)."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _kernel_matches_reference() -> None:
    from k3serve.kernels.kda import triton_gate

    from _kda_gate_cases import check_kda_gate_matches_reference

    check_kda_gate_matches_reference(triton_gate.kda_gate, "cpu", 3)
    _softplus_tail_is_relatively_exact(triton_gate.kda_gate)


def _softplus_tail_is_relatively_exact(kda_gate) -> None:
    """Where exp(x) is below 1's rounding step the gate is -a*exp(x), not 0 (a plain log(1 + exp(x)) would
    round it away): checked relatively here, where the interpreter's log is numpy's exact one."""
    import torch

    from k3serve.kernels.kda import naive

    f = torch.linspace(-60, -8, 512).reshape(4, 1, 128)
    args = (torch.zeros(1), torch.zeros(128), None)
    torch.testing.assert_close(kda_gate(f, *args), naive.kda_gate(f, *args), rtol=1e-5, atol=0)


def test_triton_kda_gate_matches_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_kernel_matches_reference")
