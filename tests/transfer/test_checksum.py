"""Checksum spec: equal bytes give equal values on any tensor and device; any single changed
16-bit word or swap of two unequal words changes lane 1; the value is exactly the documented sum
(checked against a big-int oracle, at any offset and across matmul rows and batches); and the
shares that prefill ranks compute for a decode rank add up to what that decode rank computes after
landing, for every TP ratio."""

from __future__ import annotations

import random

import pytest
import torch

from _transfer_setup import BLOCK_SIZE, close, connect, fill_random_bytes, make_side, run_transfer, shard, tiny_config
from k3serve.model.batch import ModelCache
from k3serve.model.presets import preset_config
from k3serve.transfer import checksum
from k3serve.transfer.checksum import (
    CachedRequest,
    combine_checksums,
    combine_request_checksums,
    mismatched_regions,
    region_checksum,
    request_checksums,
)
from k3serve.transfer.layout import CacheLayout, HeadSlice
from k3serve.transfer.tp_map import RequestSpan

from _triton_interpret import needs_triton, run_in_interpreter

DTYPES = [torch.float32, torch.bfloat16]


def _oracle(t: torch.Tensor, offset: int = 0) -> str:
    """The documented value, with Python ints: word w (int16) at word position p of the view adds
    (w + 32769) * (p + 1) mod 2^31 - 1 to lane 1 and (w + 32769) * R^p mod 2^31 - 19 to lane 2."""
    p1, p2, r = 2**31 - 1, 2**31 - 19, 0x5DEECE6E
    words = t.contiguous().view(-1).view(torch.int16).tolist()
    first = offset // 2
    lane1 = sum((w + 32769) * (first + j + 1) for j, w in enumerate(words)) % p1
    power, lane2 = pow(r, first, p2), 0
    for w in words:
        lane2, power = (lane2 + (w + 32769) * power) % p2, power * r % p2
    return f"{lane1:08x}{lane2:08x}"


def _whole(region: str, t: torch.Tensor, offset: int) -> checksum.Piece:
    """All of `t`'s bytes as one piece at byte `offset` of the view of `region`."""
    return checksum._piece(region, t, 0, t.numel() * t.element_size(), offset)


def _lane1(value: str) -> str:
    return value[:8]


@pytest.mark.parametrize("offset", [0, 2, 2046, 2**32 - 8192], ids=["0", "2", "2046", "4GiB-8KiB"])
@pytest.mark.parametrize("numel", [1, 511, 1024, 3000], ids=lambda n: f"{n}w")
def test_value_is_the_documented_sum(numel: int, offset: int) -> None:
    """Exact at any offset (position weights near 2^31 included) and across matrix rows."""
    t = torch.randint(-(2**15), 2**15, (numel,), dtype=torch.int16)
    t[:3] = torch.tensor([-(2**15), 2**15 - 1, 0], dtype=torch.int16)[:numel]  # extremes of a word
    assert region_checksum(t, offset) == _oracle(t, offset)


def test_pieces_split_across_matmul_batches_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A view larger than one matmul batch is cut into parts at their offsets: same value."""
    t = torch.randn(2500, dtype=torch.bfloat16)
    monkeypatch.setattr(checksum, "_BATCH_WORDS", 4 * checksum._ROW)
    assert region_checksum(t, 10) == _oracle(t, 10)
    small = torch.randn(3, dtype=torch.float32)
    pieces = [_whole("a", t, 0), _whole("b", small, 8), _whole("a", small, 5000)]
    assert checksum._checksum_pieces(pieces) == {"a": combine_checksums([_oracle(t), _oracle(small, 5000)]),
                                                 "b": _oracle(small, 8)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_any_single_changed_word_changes_lane_1(dtype: torch.dtype) -> None:
    t = torch.randn(3, 7, dtype=dtype)  # awkward size: 21 elements
    base = region_checksum(t, offset=2 * 10**6)
    words = t.view(-1).view(torch.int16)
    for i in range(words.numel()):
        for delta in (1, 255, 256, 2**15, 2**16 - 1):
            changed = t.clone()
            w = changed.view(-1).view(torch.int16)
            w[i] = (int(words[i]) + 2**15 + delta) % 2**16 - 2**15
            assert _lane1(region_checksum(changed, offset=2 * 10**6)) != _lane1(base), f"word {i} + {delta}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_any_single_changed_byte_changes_the_checksum(dtype: torch.dtype) -> None:
    t = torch.randn(3, 7, dtype=dtype)
    base = region_checksum(t)
    raw = t.view(-1).view(torch.uint8)
    for i in range(raw.numel()):
        flipped = t.clone()
        flipped.view(-1).view(torch.uint8)[i] = (int(raw[i]) + 128) % 256
        assert region_checksum(flipped) != base, f"byte {i} went unnoticed"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swapped_elements_change_lane_1(dtype: torch.dtype) -> None:
    t = torch.arange(12, dtype=dtype).reshape(3, 4)
    base = region_checksum(t)
    for i, j in [(0, 1), (0, 11), (5, 6), (3, 8)]:
        swapped = t.clone().view(-1)
        swapped[[i, j]] = swapped[[j, i]]
        assert _lane1(region_checksum(swapped)) != _lane1(base)
    assert _lane1(region_checksum(t.t())) != _lane1(base)  # same values, other order
    words = torch.tensor([7, -7, 7, 0], dtype=torch.int16)  # the two halves of one element swapped too
    assert _lane1(region_checksum(words[[1, 0, 2, 3]])) != _lane1(region_checksum(words))


def test_powers_of_r_come_from_one_table_per_device() -> None:
    """Both paths read R^q (q up to past the largest view position) from one cached table a device."""
    p2, r = 2**31 - 19, 0x5DEECE6E
    table = checksum._powers(torch.device("cpu"))
    assert checksum._powers(torch.device("cpu")) is table
    q = [0, 1, 1023, 2047, 2048, 2**22 - 1, 2**22, checksum._MAX_VIEW_WORDS, 2**33 - 1]
    assert checksum._power_at(torch.tensor(q), table).tolist() == [pow(r, x, p2) for x in q]


def test_views_off_the_word_grid_are_refused() -> None:
    with pytest.raises(ValueError, match="2-byte words"):
        region_checksum(torch.zeros(4), offset=3)
    with pytest.raises(ValueError, match="2-byte words"):
        region_checksum(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must lie in"):
        region_checksum(torch.zeros(4), offset=2**32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_identical_bytes_give_identical_checksums(dtype: torch.dtype) -> None:
    a = torch.randn(4, 5, dtype=dtype)
    b = torch.empty(20, dtype=dtype)
    b.copy_(a.reshape(-1))
    assert region_checksum(a) == region_checksum(b)
    assert region_checksum(a[1:3]) == region_checksum(b[5:15].clone())
    as_bytes = a.view(-1).view(torch.uint8).clone()
    assert region_checksum(a) == region_checksum(as_bytes)  # bytes are bytes, whatever the dtype


def test_position_weighted_and_additive() -> None:
    """A part checksummed at its offset in the view adds up to the whole view's checksum."""
    whole = torch.randn(10, 6)
    top, bottom = whole[:4], whole[4:]
    assert region_checksum(bottom) != region_checksum(bottom, offset=4 * 6 * 4)  # position matters
    assert combine_checksums([region_checksum(top), region_checksum(bottom, offset=4 * 6 * 4)]) == region_checksum(whole)
    assert combine_checksums([region_checksum(bottom, offset=96), region_checksum(top)]) == region_checksum(whole)


def test_zero_words_count() -> None:
    """An all-zero region (state never written) is not the checksum of nothing."""
    assert region_checksum(torch.zeros(8)) != combine_checksums([])
    assert region_checksum(torch.zeros(8)) != region_checksum(torch.zeros(9))


def test_mla_checksum_covers_only_the_requests_token_rows() -> None:
    config = tiny_config()
    cache = ModelCache.allocate(config, num_blocks=8, num_slots=2, block_size=BLOCK_SIZE)
    fill_random_bytes(cache, seed=3)
    layout = CacheLayout.from_cache(cache, config, 0, 1)
    blocks, tokens = [5, 2], BLOCK_SIZE + 2  # the second block holds 2 of the request's tokens
    request = CachedRequest(cache, layout, blocks, 0, tokens)
    base = request_checksums(request, heads=None)
    assert set(base) == {"mla.0", "mla.1"}
    _change(cache.mla_kv[0], (2, 3, 0))  # block tail: not the request's
    assert request_checksums(request, heads=None) == base
    _change(cache.mla_kv[0], (2, 1, 0))  # token row 5
    assert mismatched_regions(base, request_checksums(request, heads=None)) == ["mla.0"]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 8), (8, 4)])
def test_sender_shares_add_up_to_the_receivers_checksum(prefill_tp: int, decode_tp: int, metrics, registry) -> None:
    config = tiny_config()
    reference = ModelCache.allocate(config, 8, 3, BLOCK_SIZE, dtype=torch.bfloat16)
    fill_random_bytes(reference, seed=4)
    prefill = make_side(config, [shard(reference, s, prefill_tp) for s in range(prefill_tp)])
    decode = make_side(config, [ModelCache.allocate(config, 8, 3, BLOCK_SIZE, tp_size=decode_tp, dtype=torch.bfloat16) for _ in range(decode_tp)])
    span = RequestSpan((1, 2, 6), (4, 5, 0), src_slot=1, dst_slot=2, num_tokens=2 * BLOCK_SIZE + 3)
    try:
        mapping = connect(prefill, decode)
        run_transfer(mapping, prefill, decode, span)
        for r in range(decode_tp):
            shares = []
            for s in mapping.sources(r):  # computed on prefill rank s, from its own cache
                view = mapping.view(s, r)
                sent = CachedRequest(prefill.caches[s], prefill.layouts[s], span.src_block_ids, span.src_slot,
                                     span.num_tokens)  # fmt: skip
                shares.append(request_checksums(sent, heads=view.heads, include_mla=view.mla))
            expected = combine_request_checksums(shares)
            received = CachedRequest(decode.caches[r], decode.layouts[r], span.dst_block_ids, span.dst_slot,
                                     span.num_tokens)  # fmt: skip
            landed = request_checksums(received, heads=HeadSlice.whole_shard(decode.layouts[r]))
            assert set(landed) == set(decode.layouts[r].region_names)
            assert mismatched_regions(expected, landed, metrics) == []

            _change(decode.caches[r].kda_conv[1], (span.dst_slot, -1, -1))  # one corrupted value lands
            landed = request_checksums(received, heads=HeadSlice.whole_shard(decode.layouts[r]))
            assert mismatched_regions(expected, landed, metrics) == ["kda_conv.1"]
        counted = registry.get_sample_value("k3serve:transfer_checksum_mismatches_total", {"model_name": "tiny", "role": "prefill"})
        assert counted == decode_tp
    finally:
        close(prefill, decode)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 4), (2, 8), (1, 1)])
def test_a_sender_sums_all_the_views_it_feeds_in_one_pass(prefill_tp: int, decode_tp: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """views_checksums == one request_checksums per decode rank, with one lane pass whose pieces are distinct:
    the MLA rows that every view carries whole are summed once, not once per decode rank."""
    config = tiny_config()
    reference = ModelCache.allocate(config, 8, 3, BLOCK_SIZE, dtype=torch.bfloat16)
    fill_random_bytes(reference, seed=5)
    prefill = make_side(config, [shard(reference, s, prefill_tp) for s in range(prefill_tp)])
    decode = make_side(config, [ModelCache.allocate(config, 8, 3, BLOCK_SIZE, tp_size=decode_tp, dtype=torch.bfloat16)
                                for _ in range(decode_tp)])
    blocks, slot, tokens = (1, 2, 6), 1, 2 * BLOCK_SIZE + 3
    passes = []
    lanes = checksum._lanes
    monkeypatch.setattr(checksum, "_lanes", lambda pieces: passes.append(len(pieces)) or lanes(pieces))
    try:
        mapping = connect(prefill, decode)
        for s in range(prefill_tp):
            views = {r: (view.heads, view.mla) for r in range(decode_tp) if (view := mapping.view(s, r)) is not None}
            passes.clear()
            request = CachedRequest(prefill.caches[s], prefill.layouts[s], blocks, slot, tokens)
            together = checksum.views_checksums(request, views)
            assert len(passes) == 1
            one_by_one = {r: request_checksums(request, heads, mla) for r, (heads, mla) in views.items()}
            assert together == one_by_one
            assert passes[0] < sum(passes[1:]) or len(views) == 1  # the MLA pieces every view shares, once
    finally:
        close(prefill, decode)


def test_a_missing_region_is_a_mismatch() -> None:
    assert mismatched_regions({"mla.0": "0" * 16, "kda_conv.0": "1" * 16}, {"mla.0": "0" * 16}) == ["kda_conv.0"]


def _random_pieces(rng: random.Random, count: int) -> list[checksum.Piece]:
    """Pieces as request_checksums makes them, at random: a slice of a tensor or a list of block runs
    (shuffled block ids, the last run cut), odd word counts, 1-, 2- and 4-byte dtypes, random offsets
    (up to the top of the 2^31-word view), several pieces in one region."""
    pieces = []
    for _ in range(count):
        dtype = rng.choice([torch.uint8, torch.bfloat16, torch.float32])
        size = rng.choice([1, 2, 3, 7, 31, 64, 65, 200, 513])
        source = torch.randint(0, 256, (size * 16 // dtype.itemsize,), dtype=torch.uint8)
        source = source.view(dtype)  # random bytes, whatever the dtype
        nbytes = source.numel() * source.element_size()
        offset = 2 * rng.choice([0, rng.randrange(1, 5000), checksum._MAX_VIEW_WORDS - nbytes // 2])
        region = f"r{rng.randrange(4)}"
        if rng.random() < 0.4:  # block runs
            run = 2 * rng.randrange(1, min(100, nbytes // 2) + 1)
            blocks = rng.sample(range(nbytes // run), k=rng.randrange(1, min(nbytes // run, 5) + 1))
            used = 2 * rng.randrange(1, len(blocks) * run // 2 + 1)
            pieces.append(checksum._piece(region, source, 0, used, offset, run, tuple(blocks)))
        else:
            at = 2 * rng.randrange(nbytes // 2)
            pieces.append(checksum._piece(region, source, at, 2 * rng.randrange(0, (nbytes - at) // 2 + 1), offset))
    return pieces


def _kernel_matches_matmul_path(seed: int) -> None:
    """Run where TRITON_INTERPRET=1 was set before triton was imported (the interpreter runs the
    kernel on CPU tensors), with small tiles and steps so that a few hundred words span many tiles,
    steps and runs: the kernel's lanes, piece by piece, are the matmul path's and the big-int oracle's."""
    from k3serve.transfer import checksum_triton

    checksum_triton.TILE, checksum_triton.BLOCK = 64, 16
    pieces = _random_pieces(random.Random(seed), 40)
    lanes = checksum_triton.piece_lanes(pieces)
    assert lanes == checksum._matmul_lanes(pieces)
    for piece, (lane1, lane2) in zip(pieces, lanes):
        assert f"{lane1:08x}{lane2:08x}" == _oracle(checksum._words(piece), 2 * piece.offset)


@needs_triton
def test_cuda_kernel_gives_the_matmul_paths_lanes() -> None:
    """The CUDA path's Triton kernel, under the interpreter on CPU: see `_kernel_matches_matmul_path`."""
    run_in_interpreter(__file__, "_kernel_matches_matmul_path", 5)


def test_request_pieces_are_checked_against_their_tensors() -> None:
    """The CUDA path reads raw addresses: a piece outside its tensor is refused before any read."""
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside"):
        checksum._piece("r", t, 0, 32, 0, 16, (1, 4))  # block 4 of 4
    with pytest.raises(ValueError, match="outside"):
        checksum._piece("r", t, 56, 16, 0)
    with pytest.raises(ValueError, match="contiguous"):
        checksum._piece("r", t.t(), 0, 8, 0)
    config = tiny_config()
    cache = ModelCache.allocate(config, num_blocks=4, num_slots=2, block_size=BLOCK_SIZE)
    layout = CacheLayout.from_cache(cache, config, 0, 1)
    with pytest.raises(ValueError, match="outside"):
        request_checksums(CachedRequest(cache, layout, [0, 9], 0, BLOCK_SIZE + 1), heads=None)
    with pytest.raises(ValueError, match="outside"):
        request_checksums(CachedRequest(cache, layout, [], 2, 0), heads=HeadSlice.whole_shard(layout))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_and_gpu_agree(dtype: torch.dtype) -> None:
    t = torch.randn(1000, 77).to(dtype)
    assert region_checksum(t) == region_checksum(t.cuda())
    assert checksum.last_backend["checksum"] == "triton"
    assert region_checksum(t[3:9], offset=18) == region_checksum(t.cuda()[3:9], offset=18)
    assert region_checksum(t[3:9], offset=18) == _oracle(t[3:9], offset=18)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_request_checksums_at_k3_size() -> None:
    """A Kimi-K3 TP8 rank's cache (24 MLA + 69 KDA layers, ~70 MB of a 500-token request in 162
    regions, shuffled blocks): the Triton kernel on the GPU gives the CPU path's values, for the
    receiver's whole shard and for a sender's share of a TP16 decode rank's view."""
    config = preset_config("kimi-k3")
    gpu = ModelCache.allocate(config, 12, 3, 64, 8, torch.bfloat16, "cuda")
    for t in (*gpu.mla_kv, *gpu.kda_recurrent, *gpu.kda_conv):
        t.view(torch.uint8).random_(0, 256)
    cpu = ModelCache([t.cpu() for t in gpu.mla_kv], [t.cpu() for t in gpu.kda_recurrent],
                     [t.cpu() for t in gpu.kda_conv], gpu.block_size)  # fmt: skip
    layout = CacheLayout.from_cache(gpu, config, 0, 8)
    blocks, tokens = [7, 2, 11, 0, 5, 9, 3, 1], 500
    to_tp16_rank1 = HeadSlice(6, 12, 6, 6)  # heads 6-11 of this rank: the conv slot cut in q, k, v parts
    for heads, mla, regions in [(HeadSlice.whole_shard(layout), True, 162), (to_tp16_rank1, False, 138)]:
        on_gpu = request_checksums(CachedRequest(gpu, layout, blocks, 1, tokens), heads, mla)
        assert checksum.last_backend["checksum"] == "triton"
        assert on_gpu == request_checksums(CachedRequest(cpu, layout, blocks, 1, tokens), heads, mla)
        assert checksum.last_backend["checksum"] == "matmul"
        assert len(on_gpu) == regions


def _change(t: torch.Tensor, index: tuple[int, ...]) -> None:
    """Give one element other bytes (random-byte caches hold values where += 1 changes nothing)."""
    t[index] = 1.0 if bool(t[index] == 0) else 0.0


def test_block_and_slot_checksums_are_the_entry_as_its_own_view_in_any_cache():
    """The offload tiers' checksums: a block (every MLA layer, layer after layer) or a slot (every KDA pool) taken
    as its own view, so equal bytes in another cache, at another id, give the same value, and a flipped bit does not."""
    from k3serve.transfer.checksum import block_checksums, slot_checksum

    config = tiny_config()
    a = ModelCache.allocate(config, 6, 3, BLOCK_SIZE, dtype=torch.bfloat16)
    b = ModelCache.allocate(config, 4, 2, BLOCK_SIZE, dtype=torch.bfloat16)
    fill_random_bytes(a, seed=3)
    for src, dst in ((a.mla_kv, b.mla_kv), (a.kda_recurrent + a.kda_conv, b.kda_recurrent + b.kda_conv)):
        for x, y in zip(src, dst):
            y[1].copy_(x[2])
    assert block_checksums(a, [2, 5]) == [_oracle(torch.stack([kv[i] for kv in a.mla_kv])) for i in (2, 5)]
    assert block_checksums(b, [1]) == block_checksums(a, [2])
    assert slot_checksum(b, 1) == slot_checksum(a, 2)
    assert slot_checksum(a, 2) == _oracle(torch.cat([p[2].contiguous().view(-1).view(torch.uint8)
                                                     for p in a.kda_recurrent + a.kda_conv]))
    b.mla_kv[-1][1].view(-1).view(torch.uint8)[-1] ^= 1
    b.kda_conv[0][1].view(-1).view(torch.uint8)[0] ^= 4
    assert block_checksums(b, [1]) != block_checksums(a, [2]) and slot_checksum(b, 1) != slot_checksum(a, 2)
