"""The CUDA path's mid-chunk KDA checkpoint kernel (triton_checkpoint.py), run by the Triton interpreter on
CPU tensors, matches the torch reference: `naive._advance` of the chunk's start state by the chunk's
first m tokens, on the cases of `_kda_checkpoint_cases.py` (test_kda_gpu.py checks the same on the device,
where the in-chunk sum runs as 3xTF32)."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _checkpoints_match_reference() -> None:
    from _kda_checkpoint_cases import check_checkpoints_match_reference

    check_checkpoints_match_reference("cpu")


def test_checkpoints_match_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_checkpoints_match_reference")
