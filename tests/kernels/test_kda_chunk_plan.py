"""The host-built index plan of a chunked KDA call (kernels/kda/chunk_plan.py): fla's chunk indices
and offsets, and one checkpoint row (sequence, first token row of the chunk, tokens of it before the
offset, chunk row in the states) per sequence that asks for one."""

from __future__ import annotations

import torch

from k3serve.kernels.kda.chunk_plan import plan_chunks

CPU = torch.device("cpu")


def test_varlen_plan_numbers_chunks_per_sequence() -> None:
    plan = plan_chunks([150, 64, 1], True, None, 64, CPU)
    assert plan.num_seqs == 3 and plan.num_chunks == 3 + 1 + 1
    assert plan.cu_seqlens.tolist() == [0, 150, 214, 215]
    assert plan.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [2, 0]]
    assert plan.chunk_offsets.tolist() == [0, 3, 4, 5]
    assert plan.checkpoints is None


def test_checkpoint_rows_mid_chunk_on_an_edge_at_the_end_and_none() -> None:
    lens = [150, 64, 40, 200]
    plan = plan_chunks(lens, True, [77, 64, -1, 200], 64, CPU)
    assert plan.checkpoints.tolist() == [
        [0, 64, 13, 1],  # 77 = chunk 1 (tokens 64..127) + 13 of its tokens
        [1, 150, 64, 3],  # 64 = all of the sequence's only chunk, which starts at row 150
        [3, 254 + 192, 8, 5 + 3],  # 200 = chunk 3 of the last sequence + 8 tokens
    ]


def test_no_checkpoint_asked_gives_an_empty_table() -> None:
    plan = plan_chunks([100, 30], True, [-1, -1], 32, CPU)
    assert plan.checkpoints.shape == (0, 4)


def test_equal_length_rows_need_no_indices() -> None:
    plan = plan_chunks([100, 100], False, [100, 33], 64, CPU)
    assert plan.cu_seqlens is None and plan.chunk_indices is None and plan.chunk_offsets is None
    assert plan.num_chunks == 4
    assert plan.checkpoints.tolist() == [[0, 64, 36, 1], [1, 100, 33, 2]]
