"""TP mapping into a decode engine with decode context parallelism: decode rank r (DCP rank d = r % W) receives,
byte for byte, prefill blocks d, d + W, ... into its reserved blocks 0, 1, ... (its pages), its KDA heads as
without DCP, and nothing else; the senders' checksums of its pages add up to what landed."""

from __future__ import annotations

import pytest
import torch

from _transfer_setup import (BLOCK_SIZE, byte_equal, close, connect, fill_random_bytes, make_side, run_transfer, shard,
                             tiny_config)
from k3serve.model.batch import ModelCache
from k3serve.transfer.checksum import CachedRequest, combine_request_checksums, mismatched_regions, request_checksums, \
    views_checksums
from k3serve.transfer.layout import HeadSlice
from k3serve.transfer.tp_map import RequestSpan, TPMapping

SRC = (3, 4, 5, 9, 6)  # 5 prefill blocks of 4 tokens, the last one partial


def _clone(cache: ModelCache) -> ModelCache:
    return ModelCache([t.clone() for t in cache.mla_kv], [t.clone() for t in cache.kda_recurrent],
                      [t.clone() for t in cache.kda_conv], cache.block_size, dcp_size=cache.dcp_size)


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "dcp"), [(1, 2, 2), (2, 2, 2), (1, 4, 4), (2, 4, 2)],
                         ids=lambda v: str(v))
def test_each_decode_rank_receives_only_its_pages(prefill_tp: int, decode_tp: int, dcp: int) -> None:
    config = tiny_config()
    reference = ModelCache.allocate(config, num_blocks=12, num_slots=4, block_size=BLOCK_SIZE, dtype=torch.bfloat16)
    fill_random_bytes(reference, seed=1)
    dst = (7, 2, 8)[: -(-len(SRC) // dcp)]
    span = RequestSpan(SRC, dst, src_slot=2, dst_slot=3, num_tokens=4 * BLOCK_SIZE + 1, dcp_size=dcp)
    prefill = make_side(config, [shard(reference, s, prefill_tp) for s in range(prefill_tp)])
    caches = []
    for r in range(decode_tp):
        cache = ModelCache.allocate(config, num_blocks=10, num_slots=5, block_size=BLOCK_SIZE, tp_size=decode_tp,
                                    dtype=torch.bfloat16, dcp_size=dcp)
        fill_random_bytes(cache, seed=100 + r)  # poison: must survive outside this rank's pages and slot
        caches.append(cache)
    before = [_clone(c) for c in caches]
    decode = make_side(config, caches)
    try:
        mapping = connect(prefill, decode)
        assert mapping.dcp_size == dcp and [d.dcp_rank for d in decode.layouts] == [r % dcp for r in range(decode_tp)]
        run_transfer(mapping, prefill, decode, span)
        for r, got in enumerate(caches):
            want, ref = before[r], shard(reference, r, decode_tp)
            pages = list(SRC[r % dcp :: dcp])
            for w, src in zip(want.mla_kv, ref.mla_kv):
                w[list(dst[: len(pages)])] = src[pages]
            for w, src in zip(want.kda_recurrent + want.kda_conv, ref.kda_recurrent + ref.kda_conv):
                w[span.dst_slot] = src[span.src_slot]
            for i, (g, w) in enumerate(zip(got.mla_kv + got.kda_recurrent + got.kda_conv,
                                           want.mla_kv + want.kda_recurrent + want.kda_conv)):
                assert byte_equal(g, w), f"decode rank {r}: tensor {i} differs"
            shares = [views_checksums(CachedRequest(prefill.caches[s], prefill.layouts[s], SRC, span.src_slot,
                                                    span.num_tokens), {r: (v.heads, v.mla)}, dcp)[r]
                      for s in mapping.sources(r) if (v := mapping.view(s, r)) is not None]
            landed = CachedRequest(got, decode.layouts[r], dst, span.dst_slot, span.num_tokens).dcp_pages(
                dcp, r % dcp, whole_blocks=False)
            sums = request_checksums(landed, HeadSlice.whole_shard(decode.layouts[r]))
            assert mismatched_regions(combine_request_checksums(shares), sums) == []
            got.mla_kv[0].view(torch.int16)[dst[0], 0, 0] ^= 0x5A  # a landed page's first row: the sums tell
            assert mismatched_regions(combine_request_checksums(shares), request_checksums(
                landed, HeadSlice.whole_shard(decode.layouts[r]))) == ["mla.0"]
    finally:
        close(prefill, decode)


def test_a_span_of_the_wrong_page_count_or_a_prefill_engine_with_dcp_is_refused() -> None:
    with pytest.raises(ValueError, match="5 src blocks but 2 dst blocks of 2 pages"):
        RequestSpan(SRC, (1, 2), 0, 0, num_tokens=17, dcp_size=2)
    config = tiny_config()
    split = [ModelCache.allocate(config, 4, 2, BLOCK_SIZE, tp_size=2, dcp_size=2) for _ in range(2)]
    side = make_side(config, split)
    try:
        with pytest.raises(ValueError, match="a prefill engine holds whole blocks"):
            TPMapping(side.rank_caches(), side.rank_caches())
    finally:
        close(side)


def test_the_layout_carries_the_dcp_size_and_leaves_it_out_at_one() -> None:
    """A DCP decode rank's layout round-trips with its dcp_size; without DCP the JSON is what it was before, so
    a peer that predates the field still reads it."""
    from k3serve.transfer.layout import CacheLayout

    config = tiny_config()
    split = CacheLayout.from_cache(ModelCache.allocate(config, 4, 2, BLOCK_SIZE, tp_size=2, dcp_size=2), config, 1, 2)
    assert (split.dcp_size, split.dcp_rank) == (2, 1) and CacheLayout.from_json(split.to_json()) == split
    whole = CacheLayout.from_cache(ModelCache.allocate(config, 4, 2, BLOCK_SIZE), config, 0, 1)
    assert "dcp_size" not in whole.to_dict() and CacheLayout.from_json(whole.to_json()) == whole
