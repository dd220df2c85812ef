"""A vocab shard's embedding on the GPU runs the Triton kernel (one launch) and copies the bits of the torch
reference; see `_embedding_cases.py`."""

from __future__ import annotations

import pytest

from k3serve.kernels import embedding
from k3serve.kernels.embedding import shard_embedding

from _embedding_cases import check_embedding_matches_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_triton_embedding_matches_reference(tokens: int) -> None:
    embedding.last_backend.clear()
    check_embedding_matches_reference(shard_embedding, "cuda", tokens)
    assert embedding.last_backend == {"shard_embedding": "triton"}
