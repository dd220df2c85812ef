"""Specification of the MLA prefill's memory bound with prefix caching (k3-tiny's MLA layer, CPU reference kernels).

A prefill step gathers each sequence's whole context from the paged cache and up-projects it (~8 KiB a key at K3
TP8). Several prefix-cache hits admitted into one step must not hold their cached prefixes at once: the keys
gathered together carry at most the longest single cached prefix of the step (what engine/memory.py sets aside),
and the outputs are bit for bit those of each sequence prefilled in a step of its own. A step without cached
prefixes, the common case, stays one gather.
"""

from __future__ import annotations

import random

import pytest
import torch

from k3serve.model.layers import mla
from k3serve.model.layers.mla import MLAAttention, cached_prefix_groups
from k3serve.model.presets import preset_config

from _mla_prefix_steps import CachedPrefixes, random_mla_layer

BLOCK_SIZE = 8
# (name, cached prefix, new tokens): a decode row first, then prefix hits among fresh prompts. The prefixes
# (24, 40, 9) sum to 73 keys; the longest is 40.
STEP = [("decode", 5, 1), ("hit-24", 24, 6), ("fresh-10", 0, 10), ("hit-40", 40, 9), ("fresh-7", 0, 7),
        ("hit-9", 9, 5)]
LONGEST_PREFIX = 40
CONFIG = preset_config("k3-tiny")


def _setup(dtype: torch.dtype = torch.float32) -> tuple[MLAAttention, CachedPrefixes]:
    layer = random_mla_layer(CONFIG, dtype, "cpu")
    return layer, CachedPrefixes(layer, STEP, BLOCK_SIZE, CONFIG.hidden_size, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefix_hits_in_one_step_equal_each_sequence_in_a_step_of_its_own(dtype: torch.dtype) -> None:
    layer, cache = _setup(dtype)
    together = cache.step(layer, [name for name, _, _ in STEP])
    for name, prefix, _ in STEP[1:]:
        alone = cache.step(layer, [name])[name]
        assert torch.equal(together[name], alone), f"{name} (prefix {prefix}): differs from its own step"
    # a one-row step multiplies on another CPU kernel (GEMV): the decode row's reference step has a prefill too
    assert torch.equal(together["decode"], cache.step(layer, ["decode", "fresh-10"])["decode"])
    assert not together["hit-40"].isnan().any()


def _record_gathers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], int]]:
    """Instruments the layer's gather: per call, the first block of each sequence it gathers and the rows
    gathered (the real gather runs)."""
    calls: list[tuple[list[int], int]] = []
    gather = mla.gather_kv_cache

    def recorded(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor):
        packed, cu_seqlens = gather(kv_cache, block_tables, seq_lens)
        calls.append((block_tables[:, 0].tolist(), packed.shape[0]))
        return packed, cu_seqlens

    monkeypatch.setattr(mla, "gather_kv_cache", recorded)
    return calls


def test_a_step_with_several_prefix_hits_gathers_one_longest_prefix_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer, cache = _setup()
    calls = _record_gathers(monkeypatch)
    cache.step(layer, [name for name, _, _ in STEP])

    by_first_block = {cache.tables[name][0]: (name, prefix, new) for name, prefix, new in STEP}
    gathered, prefix_rows = [], []
    for first_blocks, rows in calls:
        seqs = [by_first_block[b] for b in first_blocks]
        assert rows == sum(prefix + new for _, prefix, new in seqs)
        gathered += [name for name, _, _ in seqs]
        prefix_rows.append(sum(prefix for _, prefix, _ in seqs))
    assert sorted(gathered) == sorted(name for name, _, _ in STEP[1:])  # every prefill sequence, once
    assert max(prefix_rows) == LONGEST_PREFIX  # not 24 + 40 + 9 = 73 at once
    largest = max(rows for _, rows in calls)
    assert largest <= LONGEST_PREFIX + sum(new for _, _, new in STEP[1:])


def test_a_step_without_prefix_hits_gathers_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh prompts and one chunked prompt continuing its cached prefix: one batched gather, as before."""
    layer, cache = _setup()
    calls = _record_gathers(monkeypatch)
    cache.step(layer, ["fresh-10", "hit-40", "fresh-7"])
    assert [rows for _, rows in calls] == [10 + 49 + 7]


@pytest.mark.parametrize("prefix_lens, groups", [
    ([0, 0, 0], [(0, 3)]),
    ([0, 12, 0], [(0, 3)]),
    ([24, 0, 40, 0, 9], [(0, 2), (2, 4), (4, 5)]),
    ([5, 5, 5, 10], [(0, 2), (2, 3), (3, 4)]),
])
def test_groups_examples(prefix_lens: list[int], groups: list[tuple[int, int]]) -> None:
    assert cached_prefix_groups(prefix_lens) == groups


def test_groups_cover_the_sequences_in_order_under_the_longest_prefix() -> None:
    rng = random.Random(0)
    for _ in range(200):
        prefix_lens = [rng.choice([0, 0, rng.randrange(1, 100)]) for _ in range(rng.randrange(1, 12))]
        groups = cached_prefix_groups(prefix_lens)
        assert [a for a, _ in groups] == [0] + [b for _, b in groups[:-1]] and groups[-1][1] == len(prefix_lens)
        assert all(a < b and sum(prefix_lens[a:b]) <= max(prefix_lens) for a, b in groups), prefix_lens
