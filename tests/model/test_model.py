"""Specification of the model's contract with the engine, on both tiny models (fp32, CPU).

However a sequence is cut into forward passes (one pass, chunked prefill with chunks that split
MLA blocks and KDA conv windows, token-by-token decode) and whatever it shares a batch with, its
logits are those of one pass over the sequence alone. Caches are addressed only through the
batch's block tables and slots: poisoning every other slot and block changes nothing. An in-pass
KDA checkpoint plus the shared MLA blocks is a complete prefix: a new sequence resumes from it.
"""

from __future__ import annotations

import pytest
import torch

from k3serve.model.layers.mlp import RoutedExperts
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM

from _runs import (
    BLOCK_SIZE,
    Chunk,
    allocate,
    assert_logits_close,
    blocks_for,
    forward,
    mixed_seqs,
    mixed_step,
    run_alone,
    run_in_chunks,
)

SEQ_LEN = 37  # 4 full MLA blocks + 5 tokens


@pytest.fixture(scope="module", params=["k3-tiny", "kimi-linear-tiny"])
def model(request: pytest.FixtureRequest) -> KimiForCausalLM:
    fixture = {"k3-tiny": "tiny_checkpoint", "kimi-linear-tiny": "kimi_linear_tiny_checkpoint"}[request.param]
    return load_model(request.getfixturevalue(fixture))


def _tokens(model: KimiForCausalLM, n: int) -> list[int]:
    return torch.randint(0, model.config.vocab_size, (n,)).tolist()


# -- (a) how a sequence is cut into passes does not matter -----------------------------------------

SCHEDULES = {  # chunk sizes summing to SEQ_LEN; a 1 is a decode step
    "block-aligned": [8, 8, 8, 8, 5],
    "chunks-of-5": [5, 5, 5, 5, 5, 5, 5, 2],
    "chunks-of-11": [11, 11, 11, 4],
    "short-chunks-inside-conv-window": [2, 2, 3, 9, 2, 1, 13, 5],  # 2 < kernel-1: the window spans chunks
    "prefill-then-decode": [13] + [1] * 24,
    "token-by-token": [1] * SEQ_LEN,
}


@pytest.mark.parametrize("chunk_sizes", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_chunked_prefill_and_decode_match_one_pass(model: KimiForCausalLM, chunk_sizes: list[int]) -> None:
    token_ids = _tokens(model, SEQ_LEN)
    ref = run_alone(model, token_ids)
    out = run_in_chunks(model, allocate(model), token_ids, chunk_sizes)
    assert_logits_close("chunked", ref, out)


# -- (b) causality -----------------------------------------------------------------------------------


def test_appended_tokens_do_not_change_earlier_logits(model: KimiForCausalLM) -> None:
    prefix, tail_a, tail_b = _tokens(model, 20), _tokens(model, 9), _tokens(model, 15)
    seqs = [prefix, prefix + tail_a, prefix + tail_b]  # one batch, one slot and block range each
    chunks = [Chunk(s, 0, blocks_for(len(s), first=8 * i), slot_id=i) for i, s in enumerate(seqs)]
    alone, longer_a, longer_b = forward(model, allocate(model), chunks)
    assert_logits_close("prefix vs +tail_a", alone, longer_a[:20])
    assert_logits_close("prefix vs +tail_b", alone, longer_b[:20])
    assert (longer_a[20] - longer_b[20]).abs().max() > 1e-2  # the tails do differ


# -- (c) a mixed batch equals each sequence alone ----------------------------------------------------


def test_mixed_decode_and_prefill_batch_matches_each_sequence_alone(model: KimiForCausalLM) -> None:
    seqs = mixed_seqs(model.config.vocab_size)
    out = dict(zip("abcd", mixed_step(model, allocate(model, num_blocks=8, num_slots=4), seqs)))
    ref = {name: run_alone(model, tokens) for name, tokens in seqs.items()}
    assert_logits_close("decode a (absorbed MLA) vs one pass (MHA)", ref["a"][12:], out["a"])
    assert_logits_close("decode b (absorbed MLA) vs one pass (MHA)", ref["b"][9:], out["b"])
    assert_logits_close("fresh prefill c", ref["c"], out["c"])
    assert_logits_close("continued chunk d", ref["d"][6:], out["d"])


# -- (d) state isolation -------------------------------------------------------------------------------


def _poison(cache, value: float) -> None:
    for pool in cache.mla_kv + cache.kda_recurrent + cache.kda_conv:
        pool.fill_(value)


@pytest.mark.parametrize("poison", [1e30, float("nan")], ids=["1e30", "nan"])
def test_poisoned_pools_do_not_change_results(model: KimiForCausalLM, poison: float) -> None:
    """Every slot and block starts poisoned (3x as many as needed): a fresh sequence zeroes its KDA
    slot, MLA rows are written before they are read, and nothing else is ever read."""
    seqs = mixed_seqs(model.config.vocab_size)
    clean = mixed_step(model, allocate(model, num_blocks=8, num_slots=4), seqs)
    poisoned_cache = allocate(model, num_blocks=24, num_slots=12)
    _poison(poisoned_cache, poison)
    poisoned = mixed_step(model, poisoned_cache, seqs)
    for name, ref, out in zip("abcd", clean, poisoned):
        assert torch.equal(ref, out), f"sequence {name}: poisoned pool changed the logits"


# -- (e) prefix reuse from an in-pass KDA checkpoint ----------------------------------------------------

PREFIX = 2 * BLOCK_SIZE  # two full MLA blocks
CHECKPOINTED_PREFILLS = {  # chunk sizes of the first sequence; the checkpoint lands at token PREFIX
    "one-chunk-20": [20],
    "chunks-14-6": [14, 6],  # offset 2 in the chunk: the conv window reaches into the previous chunk
    "chunks-13-7": [13, 7],  # offset 3 = kernel-1
    "chunks-9-11": [9, 11],
    "prefill-15-then-decode": [15, 1, 1],  # the checkpoint is taken by a decode step
}


@pytest.mark.parametrize("chunk_sizes", CHECKPOINTED_PREFILLS.values(), ids=CHECKPOINTED_PREFILLS.keys())
def test_new_sequence_resumes_from_kda_checkpoint_and_shared_blocks(
    model: KimiForCausalLM, chunk_sizes: list[int]
) -> None:
    first = _tokens(model, sum(chunk_sizes))
    second = first[:PREFIX] + _tokens(model, 14)
    cache = allocate(model, num_blocks=8, num_slots=4)
    _poison(cache, float("nan"))  # the checkpoint must write the whole state of its slot
    first_slot, checkpoint_slot, second_slot = 0, 3, 1
    first_blocks = [4, 0, 6]  # [0 .. 8) [8 .. 16) [16 .. 24)

    start, first_logits = 0, []
    for size in chunk_sizes:
        chunk = Chunk(first[start : start + size], start, first_blocks, first_slot)
        offset = PREFIX - start if start < PREFIX <= start + size else -1
        first_logits += forward(model, cache, [chunk], [offset], [checkpoint_slot if offset > 0 else -1])
        start += size
    assert_logits_close("checkpointing leaves the sequence alone", run_alone(model, first), torch.cat(first_logits))

    cache.copy_slot(checkpoint_slot, second_slot)
    second_blocks = first_blocks[:2] + [2, 5]  # the two shared blocks, then its own
    resumed = forward(model, cache, [Chunk(second[PREFIX:], PREFIX, second_blocks, second_slot)])[0]
    assert_logits_close("resumed from the checkpoint", run_alone(model, second)[PREFIX:], resumed)


# -- (f) packed experts ----------------------------------------------------------------------------------


def test_k3_routed_experts_stay_mxfp4_packed_in_memory(tiny_checkpoint) -> None:
    model = load_model(tiny_checkpoint)
    banks = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert len(banks) == model.config.num_hidden_layers - model.config.first_k_dense_replace
    for bank in banks:
        buffers = dict(bank.named_buffers())
        assert sorted(buffers) == sorted(f"{p}_{k}" for p in ("w1", "w2", "w3") for k in ("packed", "scale"))
        assert all(b.dtype == torch.uint8 for b in buffers.values()), {n: b.dtype for n, b in buffers.items()}
    expert_bytes = sum(b.numel() for bank in banks for b in bank.buffers())
    dense_values = sum(b.numel() * 2 for bank in banks for n, b in bank.named_buffers() if n.endswith("packed"))
    assert expert_bytes < dense_values * 0.6  # 4.25 bits (0.53 bytes) per weight, not 4 bytes


def test_kimi_linear_routed_experts_are_dense(kimi_linear_tiny_checkpoint) -> None:
    model = load_model(kimi_linear_tiny_checkpoint)
    for bank in (m for m in model.modules() if isinstance(m, RoutedExperts)):
        dtypes = {n: b.dtype for n, b in bank.named_buffers()}
        assert dtypes == {f"{p}_weight": torch.float32 for p in ("w1", "w2", "w3")}

