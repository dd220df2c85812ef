"""The CUDA path's shard-embedding kernel, run by the Triton interpreter on CPU tensors, copies the same bits
as the torch reference on the cases of `_embedding_cases.py` (test_embedding_gpu.py checks them on the device)."""

from __future__ import annotations

from _triton_interpret import needs_triton, run_in_interpreter

pytestmark = needs_triton


def _kernel_matches_reference() -> None:
    from k3serve.kernels.embedding import triton_embedding

    from _embedding_cases import check_embedding_matches_reference

    check_embedding_matches_reference(triton_embedding.shard_embedding, "cpu", 5)


def test_triton_embedding_matches_reference_under_interpreter() -> None:
    run_in_interpreter(__file__, "_kernel_matches_reference")
