"""The host-built index plan of a chunked KDA call (kernels/kda/chunk_plan.py): fla's chunk indices
and offsets, and one checkpoint row per sequence (first token row of the chunk holding the offset,
tokens of it before the offset, chunk row in the states; 0 tokens for a sequence without one). The
plan validates its host lists, and `chunk_kda` given a plan uses it instead of reading the sequence
tensors, once it fits the call."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels.kda import chunk_kda
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
        [64, 13, 1],  # 77 = chunk 1 (tokens 64..127) + 13 of its tokens
        [150, 64, 3],  # 64 = all of the sequence's only chunk, which starts at row 150
        [214, 0, 4],  # none: 0 tokens (the zero state), at the sequence's first chunk
        [254 + 192, 8, 5 + 3],  # 200 = chunk 3 of the last sequence + 8 tokens
    ]


def test_no_checkpoint_asked_gives_zero_token_rows() -> None:
    plan = plan_chunks([100, 30], True, [-1, -1], 32, CPU)
    assert plan.checkpoints.tolist() == [[0, 0, 0], [100, 0, 4]]


def test_index_tensors_start_16_byte_aligned_for_any_sequence_count() -> None:
    """fla's kernels are compiled per pointer alignment; tensors of their own would be aligned, so the
    packed ones must be too (two sequences: an odd cu_seqlens length before the chunk indices)."""
    for lens in ([100], [100, 30], [5, 6, 7]):
        plan = plan_chunks(lens, True, [-1] * len(lens), 64, CPU)
        for t in (plan.cu_seqlens, plan.chunk_indices, plan.chunk_offsets, plan.checkpoints):
            assert t.data_ptr() % 16 == 0, (lens, t)
        assert plan.chunk_offsets.tolist() == [0, *torch.tensor(lens).add(63).div(64, rounding_mode="floor").cumsum(0)]


def test_equal_length_rows_need_no_indices() -> None:
    plan = plan_chunks([100, 100], False, [100, 33], 64, CPU)
    assert plan.cu_seqlens is None and plan.chunk_indices is None and plan.chunk_offsets is None
    assert plan.num_chunks == 4
    assert plan.checkpoints.tolist() == [[64, 36, 1], [100, 33, 2]]


def test_plan_validates_its_host_lists() -> None:
    with pytest.raises(ValueError, match="sequences of >= 1 token"):
        plan_chunks([5, 0], True, None, 64, CPU)
    with pytest.raises(ValueError, match=r"checkpoint_offsets must be -1 or in \[1, len_n\]"):
        plan_chunks([5, 4], True, [5, 0], 64, CPU)
    with pytest.raises(ValueError, match=r"checkpoint_offsets must be -1 or in \[1, len_n\]"):
        plan_chunks([5, 4], True, [5], 64, CPU)


def _kda_inputs(T: int, H: int = 2, K: int = 16):
    q, k, v = (torch.randn(1, T, H, K) for _ in range(3))
    return q, k, v, -torch.rand(1, T, H, K), torch.rand(1, T, H)


def test_chunk_kda_with_a_plan_equals_without_and_refuses_one_that_does_not_fit() -> None:
    """A plan stands in for reading the sequence tensors back; it must describe the same call."""
    lens, offsets = [10, 3, 20], [4, -1, 20]
    inputs = _kda_inputs(sum(lens))
    cu, ckpt = torch.tensor([0, 10, 13, 33]), torch.tensor(offsets)
    h0 = torch.randn(3, 2, 16, 16)
    plan = plan_chunks(lens, True, offsets, 64, CPU)
    want = chunk_kda(*inputs, initial_state=h0, cu_seqlens=cu, checkpoint_offsets=ckpt)
    got = chunk_kda(*inputs, initial_state=h0, cu_seqlens=cu, checkpoint_offsets=ckpt, plan=plan)
    assert all(torch.equal(w, g) for w, g in zip(want, got))

    wrong = {
        "do not match the chunk plan's lengths": dict(plan=plan_chunks([11, 2, 20], True, offsets, 64, CPU)),
        "differ from the chunk plan's": dict(plan=plan_chunks(lens, True, [5, -1, 20], 64, CPU)),
        "same varlen / checkpoint form": dict(plan=plan_chunks(lens, True, None, 64, CPU)),
        "do not pack q's": dict(plan=plan_chunks([10, 3], True, [4, -1], 64, CPU)),
        "chunk_size 32": dict(plan=plan_chunks(lens, True, offsets, 32, CPU)),
        "lives on meta": dict(plan=plan_chunks(lens, True, offsets, 64, torch.device("meta"))),
    }
    for message, kwargs in wrong.items():
        with pytest.raises(ValueError, match=message):
            chunk_kda(*inputs, initial_state=h0, cu_seqlens=cu, checkpoint_offsets=ckpt, **kwargs)
