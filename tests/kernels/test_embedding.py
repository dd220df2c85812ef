"""A vocab shard's embedding: the rows of the ids it holds, zero rows for the others, so that the sum over the
ranks is the whole table's lookup; arguments checked at the edge."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels.embedding import shard_embedding


def test_shards_sum_to_the_whole_lookup() -> None:
    table = torch.randn(30, 16)  # 3 shards of 10 rows
    ids = torch.tensor([0, 9, 10, 29, 15, 3])
    parts = [shard_embedding(table[s : s + 10], ids, s) for s in (0, 10, 20)]
    assert torch.equal(sum(parts), table[ids])
    assert torch.equal(parts[1][[0, 1, 3, 5]], torch.zeros(4, 16))


def test_writes_into_out() -> None:
    out = torch.full((2, 8), float("nan"))
    assert shard_embedding(torch.ones(4, 8), torch.tensor([5, 1]), 4, out) is out
    assert torch.equal(out, torch.tensor([[1.0] * 8, [0.0] * 8]))


def test_argument_errors_name_the_expected_form() -> None:
    weight = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"weight must be \[S, D\]"):
        shard_embedding(torch.randn(4), torch.tensor([1]), 0)
    with pytest.raises(ValueError, match=r"token_ids must be integer \[T\]"):
        shard_embedding(weight, torch.tensor([1.0]), 0)
    with pytest.raises(ValueError, match="start must be >= 0"):
        shard_embedding(weight, torch.tensor([1]), -1)
    with pytest.raises(ValueError, match=r"out must be torch.float32 \(1, 8\)"):
        shard_embedding(weight, torch.tensor([1]), 0, torch.empty(1, 8, dtype=torch.bfloat16))
