"""TP mapping spec: after a request's writes land, decode rank r of a TP-D engine holds, byte for
byte, what it would hold had it computed the request itself (the TP-D shard of a TP-1 cache), in
the reserved blocks and slot only; every other byte of its cache is unchanged."""

from __future__ import annotations

import pytest
import torch

from _transfer_setup import BLOCK_SIZE, byte_equal, close, connect, fill_random_bytes, make_side, run_transfer, shard, tiny_config
from k3serve.model.batch import ModelCache
from k3serve.transfer.layout import HeadSlice
from k3serve.transfer.tp_map import PairView, RequestSpan, TPMapping, sending_ranks

TP_SIZES = [1, 2, 4, 8]
# tokens 0..12 of a request in 4 blocks of 4: a partial last block, and runs that coalesce on one
# side only ((3,4,5) -> (7,8,9) is one run; 9 -> 2 is not adjacent to anything)
SPAN = RequestSpan(src_block_ids=(3, 4, 5, 9), dst_block_ids=(7, 8, 9, 2), src_slot=2, dst_slot=3, num_tokens=3 * BLOCK_SIZE + 1)


def expected_decode_rank(before: ModelCache, reference: ModelCache, rank: int, tp: int, span: RequestSpan) -> ModelCache:
    """`before` (the poisoned decode cache) with the reserved blocks and slot replaced by the
    TP-`tp` rank-`rank` shard of the prefill reference."""
    want = ModelCache([t.clone() for t in before.mla_kv], [t.clone() for t in before.kda_recurrent],
                      [t.clone() for t in before.kda_conv], before.block_size)  # fmt: skip
    ref = shard(reference, rank, tp)
    for dst, src in zip(want.mla_kv, ref.mla_kv):
        dst[list(span.dst_block_ids)] = src[list(span.src_block_ids)]
    for dst, src in zip(want.kda_recurrent + want.kda_conv, ref.kda_recurrent + ref.kda_conv):
        dst[span.dst_slot] = src[span.src_slot]
    return want


@pytest.mark.parametrize("decode_tp", TP_SIZES, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("prefill_tp", TP_SIZES, ids=lambda p: f"P{p}")
def test_each_decode_rank_receives_exactly_its_shard(prefill_tp: int, decode_tp: int) -> None:
    config = tiny_config()
    reference = ModelCache.allocate(config, num_blocks=12, num_slots=4, block_size=BLOCK_SIZE, dtype=torch.bfloat16)
    fill_random_bytes(reference, seed=1)
    prefill = make_side(config, [shard(reference, s, prefill_tp) for s in range(prefill_tp)])
    decode_caches = []
    for r in range(decode_tp):
        cache = ModelCache.allocate(config, num_blocks=16, num_slots=5, block_size=BLOCK_SIZE, tp_size=decode_tp, dtype=torch.bfloat16)
        fill_random_bytes(cache, seed=100 + r)  # poison: must survive outside the reservation
        decode_caches.append(cache)
    before = [ModelCache([t.clone() for t in c.mla_kv], [t.clone() for t in c.kda_recurrent],
                         [t.clone() for t in c.kda_conv], c.block_size) for c in decode_caches]  # fmt: skip
    decode = make_side(config, decode_caches)
    try:
        mapping = connect(prefill, decode)
        run_transfer(mapping, prefill, decode, SPAN)
        for r, got in enumerate(decode_caches):
            want = expected_decode_rank(before[r], reference, r, decode_tp, SPAN)
            for name, g, w in [
                *((f"mla.{i}", g, w) for i, (g, w) in enumerate(zip(got.mla_kv, want.mla_kv))),
                *((f"kda_recurrent.{j}", g, w) for j, (g, w) in enumerate(zip(got.kda_recurrent, want.kda_recurrent))),
                *((f"kda_conv.{j}", g, w) for j, (g, w) in enumerate(zip(got.kda_conv, want.kda_conv))),
            ]:
                assert byte_equal(g, w), f"P{prefill_tp}->D{decode_tp}: decode rank {r} region {name} differs"
    finally:
        close(prefill, decode)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "pairs"),
    [
        (1, 1, [(0, 0)]),
        (2, 1, [(0, 0), (1, 0)]),
        (1, 2, [(0, 0), (0, 1)]),
        (4, 2, [(0, 0), (1, 0), (1, 1), (2, 1), (3, 1)]),
        (8, 1, [(s, 0) for s in range(8)]),
        (1, 8, [(0, r) for r in range(8)]),
    ],
    ids=lambda v: str(v) if not isinstance(v, list) else "",
)
def test_pairs_mla_source_and_head_slices(prefill_tp: int, decode_tp: int, pairs: list[tuple[int, int]]) -> None:
    """MLA comes once per decode rank, from prefill rank r % P; KDA heads from their owners."""
    config = tiny_config()
    prefill, decode = _sides(config, prefill_tp, decode_tp)
    try:
        mapping = connect(prefill, decode)
        assert mapping.pairs == pairs
        assert mapping.sending_ranks() == set(range(prefill_tp)) == sending_ranks(prefill_tp, decode_tp, 8)
        for r in range(decode_tp):  # a decode rank checking one peer at handshake sees the same pairs
            own = TPMapping(prefill.rank_caches()[:1], decode.rank_caches()[r : r + 1])
            assert own.pairs == [(0, r)] * (mapping.view(0, r) is not None)
            assert own.view(0, r) == mapping.view(0, r)
        for r in range(decode_tp):
            assert [s for s in mapping.sources(r) if mapping.view(s, r).mla] == [r % prefill_tp]
            slices = [mapping.view(s, r).heads for s in mapping.sources(r)]
            covered = [h for sl in slices if sl is not None for h in range(sl.start, sl.stop)]
            per = 8 // decode_tp
            assert covered == list(range(r * per, (r + 1) * per))
        if (prefill_tp, decode_tp) == (4, 2):
            assert mapping.view(1, 0) == PairView(mla=False, heads=HeadSlice(start=2, stop=4, view_start=0, view_heads=4))
            assert mapping.view(1, 1) == PairView(mla=True, heads=None)  # MLA only: s1 has none of r1's heads
            assert mapping.view(3, 1) == PairView(mla=False, heads=HeadSlice(start=6, stop=8, view_start=4, view_heads=4))
    finally:
        close(prefill, decode)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "pair", "num_ops"),
    [
        # 2 MLA layers x 2 block runs + 4 KDA layers x (1 recurrent + conv q|k|v merged into 1)
        (1, 1, (0, 0), 2 * 2 + 4 * (1 + 1)),
        # KDA only (MLA comes from rank 0): 4 layers x (1 recurrent + 3 conv sub-blocks)
        (2, 1, (1, 0), 4 * (1 + 3)),
        (1, 2, (0, 1), 2 * 2 + 4 * (1 + 3)),
    ],
)
def test_op_count_coalesces_blocks_and_adjacent_sub_blocks(prefill_tp: int, decode_tp: int, pair: tuple[int, int], num_ops: int) -> None:
    prefill, decode = _sides(tiny_config(), prefill_tp, decode_tp)
    try:
        ops = connect(prefill, decode).ops(SPAN)
        assert len(ops[pair]) == num_ops
    finally:
        close(prefill, decode)


def test_rejects_spans_that_do_not_fit() -> None:
    prefill, decode = _sides(tiny_config(), 1, 1)
    try:
        mapping = connect(prefill, decode)
        with pytest.raises(ValueError, match="fill 4 blocks"):
            mapping.ops(RequestSpan((1, 2, 3), (1, 2, 3), 0, 0, num_tokens=13))
        with pytest.raises(ValueError, match="block ids out of range"):
            mapping.ops(RequestSpan((1,), (16,), 0, 0, num_tokens=2))
        with pytest.raises(ValueError, match="slot out of range"):
            mapping.ops(RequestSpan((1,), (1,), 0, 5, num_tokens=2))
        with pytest.raises(ValueError, match="src blocks"):
            RequestSpan((1, 2), (1,), 0, 0, num_tokens=5)
    finally:
        close(prefill, decode)


def test_refuses_incompatible_peers() -> None:
    """Different conv kernel -> different compat hash: no mapping, before any write."""
    prefill = _side(tiny_config(), 1)
    decode = _side(tiny_config(short_conv_kernel_size=3), 1)
    try:
        with pytest.raises(ValueError, match="incompatible"):
            TPMapping(prefill.rank_caches(), decode.rank_caches())
    finally:
        close(prefill, decode)


def test_refuses_a_peer_with_an_unregistered_state_region() -> None:
    """Fail closed: a decode rank that did not register its KDA state is not a valid target."""
    prefill, decode = _sides(tiny_config(), 1, 1)
    try:
        ranks = decode.rank_caches()
        del ranks[0].regions["kda_recurrent.2"]
        with pytest.raises(ValueError, match=r"not registered: \['kda_recurrent.2'\]"):
            TPMapping(prefill.rank_caches(), ranks)
    finally:
        close(prefill, decode)


def _side(config, tp: int):
    return make_side(config, [ModelCache.allocate(config, 16, 5, BLOCK_SIZE, tp_size=tp, dtype=torch.bfloat16) for _ in range(tp)])


def _sides(config, prefill_tp: int, decode_tp: int):
    return _side(config, prefill_tp), _side(config, decode_tp)
