"""The scratch estimates the kernel packages export for the memory plan (`engine/memory.py` sums them): each
bounds what its kernel's own launch rule allocates, and grows with what the kernel's scratch grows with.
(What a real step allocates against the sum: tests/engine/test_prefill_memory_gpu.py, test_warmup_gpu.py.)"""

from __future__ import annotations

import pytest

from k3serve.engine.sampler import SAMPLER_LOGITS_COPIES, sampling_workspace_bytes
from k3serve.kernels._backend import AUTOTUNE_FLUSH_BYTES
from k3serve.kernels.kda import CHUNK_SIZE, chunk_kda_workspace_bytes
from k3serve.kernels.mla import decode_workspace_bytes, split_rule
from k3serve.kernels.moe import fused_experts_workspace_bytes

LATENT = 512


@pytest.mark.parametrize("num_heads", [8, 12, 16, 32, 64])
@pytest.mark.parametrize("num_sm", [108, 132, 148])
def test_mla_decode_partials_never_exceed_the_estimate(num_heads: int, num_sm: int) -> None:
    """Whatever the batch and the context, the split-K partials of the splits `split_plan` picks (at the stages of
    a GPU with the most or the least shared memory) fit in `decode_workspace_bytes`."""
    bound = decode_workspace_bytes(num_heads, LATENT, num_sm)
    groups = split_rule.head_groups(num_heads)
    largest = 0
    for shared in (0, split_rule.TWO_PAGES_SHARED_BYTES):
        waves = split_rule.default_waves(split_rule.num_stages(num_heads, shared))
        for num_seqs in (1, 2, 3, 5, 8, 16, 31, 64, 128, 256):
            for max_pages in (1, 2, 7, 64, 129, 512, 2048):
                splits, _ = split_rule.split_plan(num_seqs, groups, max_pages, num_sm, waves)
                if splits > 1:  # one split writes the output directly
                    largest = max(largest, num_seqs * num_heads * splits * (LATENT + 1) * 4)
    assert 0 < largest <= bound
    assert largest > bound / 4, "the estimate is a bound, not a guess: within 4x of the largest partials"


def test_fla_chunk_scratch_grows_with_the_tokens_and_the_sequences_and_holds_the_autotune_flush() -> None:
    H, d, b = 12, 128, 2
    base = chunk_kda_workspace_bytes(4096, 1, H, d, b)
    assert base > AUTOTUNE_FLUSH_BYTES
    sizes = [chunk_kda_workspace_bytes(T, 1, H, d, b) for T in (4096, 8192, 12288)]
    assert sizes[2] - sizes[1] == sizes[1] - sizes[0] > 0  # each token adds the same (whole chunks)
    extra_chunk_states = 7 * H * d * d * b  # 7 more sequences: 7 more chunk-start states
    assert chunk_kda_workspace_bytes(4096, 8, H, d, b) - base in (0, extra_chunk_states)
    one_chunk = chunk_kda_workspace_bytes(CHUNK_SIZE, 1, H, d, b) - AUTOTUNE_FLUSH_BYTES
    assert one_chunk >= 3 * CHUNK_SIZE * H * d * b  # q, k, v made contiguous at least


def test_moe_scratch_counts_h_for_every_pick_and_the_autotune_flush() -> None:
    T, top_k, hidden, inter, b = 1000, 16, 3584, 3072, 2
    bytes_ = fused_experts_workspace_bytes(T, top_k, hidden, inter, b)
    assert bytes_ - AUTOTUNE_FLUSH_BYTES >= T * top_k * inter * b  # h [T * top_k, I]
    assert fused_experts_workspace_bytes(2 * T, top_k, hidden, inter, b) - bytes_ == bytes_ - AUTOTUNE_FLUSH_BYTES


def test_sampling_scratch_is_the_sampler_copies_of_the_fp32_logits() -> None:
    assert sampling_workspace_bytes(64, 163840) == SAMPLER_LOGITS_COPIES * 64 * 163840 * 4
