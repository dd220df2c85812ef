"""Running a tiny model the way the engine does: sequences fed in chunks through ForwardBatch, each
with its own KDA slot and MLA blocks. Shared by the model tests; see test_model.py for the spec."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from k3serve.model.batch import ForwardBatch, ModelCache
from k3serve.model.model import KimiForCausalLM

BLOCK_SIZE = 8  # MLA block size in every model test: chunk sizes are chosen around it
LOGIT_ATOL = 1e-4  # fp32; scaled by the logits' magnitude (max |logit| is ~4 for the tiny models)


@dataclass
class Chunk:
    """New tokens of one sequence in one forward pass."""

    token_ids: list[int]  # [q] the new tokens
    num_computed: int  # tokens of this sequence already in the cache
    block_ids: list[int]  # the sequence's MLA block table (must cover num_computed + q)
    slot_id: int  # the sequence's KDA state slot


def blocks_for(num_tokens: int, first: int = 0) -> list[int]:
    return list(range(first, first + math.ceil(num_tokens / BLOCK_SIZE)))


def allocate(model: KimiForCausalLM, num_blocks: int = 32, num_slots: int = 8) -> ModelCache:
    return ModelCache.allocate(
        model.config, num_blocks=num_blocks, num_slots=num_slots, block_size=BLOCK_SIZE, tp_size=model.tp.world_size
    )


def forward(
    model: KimiForCausalLM,
    cache: ModelCache,
    chunks: list[Chunk],
    checkpoint_offsets: list[int] | None = None,
    checkpoint_slot_ids: list[int] | None = None,
) -> list[Tensor]:
    """One forward pass over `chunks` packed in one batch; the logits of every new token, per chunk.
    A chunk starting a sequence gets its KDA slot zeroed first, as the runner does."""
    cache.zero_slots([c.slot_id for c in chunks if c.num_computed == 0])
    batch = ForwardBatch.build(
        [c.token_ids for c in chunks],
        [c.num_computed for c in chunks],
        [c.block_ids for c in chunks],
        [c.slot_id for c in chunks],
        BLOCK_SIZE,
        checkpoint_offsets=checkpoint_offsets,
        checkpoint_slot_ids=checkpoint_slot_ids,
    )
    logits = model.compute_logits(model(batch, cache))
    if logits is None:  # a rank > 0 of a TP model: the logits were gathered to rank 0
        logits = torch.empty(sum(len(c.token_ids) for c in chunks), 0)
    return list(logits.split([len(c.token_ids) for c in chunks]))


def run_in_chunks(
    model: KimiForCausalLM, cache: ModelCache, token_ids: list[int], chunk_sizes: list[int],
    block_ids: list[int] | None = None, slot_id: int = 0,
) -> Tensor:
    """Feed one sequence alone, chunk by chunk; logits [len(token_ids), vocab]."""
    assert sum(chunk_sizes) == len(token_ids)
    block_ids = blocks_for(len(token_ids)) if block_ids is None else block_ids
    out, start = [], 0
    for size in chunk_sizes:
        out += forward(model, cache, [Chunk(token_ids[start : start + size], start, block_ids, slot_id)])
        start += size
    return torch.cat(out)


def run_alone(model: KimiForCausalLM, token_ids: list[int]) -> Tensor:
    """The reference: the whole sequence in one pass, alone, in a fresh cache."""
    return run_in_chunks(model, allocate(model), token_ids, [len(token_ids)])


def mixed_step(model: KimiForCausalLM, cache: ModelCache, seqs: dict[str, list[int]]) -> list[Tensor]:
    """History alone first, then one pass: 2 decode tokens (absorbed MLA, from 12 and 9 cached
    tokens), a fresh 10-token prefill, and a 7-token chunk continuing 6 cached tokens."""
    a, b, c, d = seqs["a"], seqs["b"], seqs["c"], seqs["d"]
    tables = {"a": [3, 1], "b": [0, 7], "c": [5, 2], "d": [6, 4]}  # deliberately out of order
    slots = {"a": 2, "b": 0, "c": 3, "d": 1}
    forward(model, cache, [Chunk(a[:12], 0, tables["a"], slots["a"])])
    forward(model, cache, [Chunk(b[:9], 0, tables["b"], slots["b"])])
    forward(model, cache, [Chunk(d[:6], 0, tables["d"], slots["d"])])
    return forward(model, cache, [
        Chunk(a[12:13], 12, tables["a"], slots["a"]),
        Chunk(b[9:10], 9, tables["b"], slots["b"]),
        Chunk(c[:10], 0, tables["c"], slots["c"]),
        Chunk(d[6:13], 6, tables["d"], slots["d"]),
    ])


def mixed_seqs(vocab_size: int) -> dict[str, list[int]]:
    """Token ids of the four sequences of `mixed_step` (from torch's global RNG)."""
    lens = {"a": 13, "b": 10, "c": 10, "d": 13}
    return {name: torch.randint(0, vocab_size, (n,)).tolist() for name, n in lens.items()}


def max_diff(ref: Tensor, out: Tensor) -> float:
    return (ref.double() - out.double()).abs().max().item()


def assert_logits_close(name: str, ref: Tensor, out: Tensor, atol: float = LOGIT_ATOL) -> None:
    """|out - ref| <= atol * max(1, max |ref|) everywhere; no NaN; the message gives the max diff."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not out.isnan().any(), f"{name}: NaN in logits"
    bound = atol * max(1.0, ref.abs().max().item())
    diff = max_diff(ref, out)
    assert diff <= bound, f"{name}: max abs diff {diff:.3e} > {bound:.3e} (logits up to {ref.abs().max().item():.2f})"
