"""BlockPool: ids of the paged MLA latent KV. Ref counts, pins, prefix hashes, LRU eviction."""

import pytest

from k3serve.engine.block_pool import BlockPool, compute_block_hashes, hash_block_tokens


def test_allocate_and_free_round_trip():
    pool = BlockPool(num_blocks=10, block_size=4)
    assert pool.can_allocate(10) and not pool.can_allocate(11)
    blocks = pool.allocate(7)
    assert len(set(blocks)) == 7
    assert pool.num_free_blocks == 3 and pool.num_used == 7 and pool.usage == pytest.approx(0.7)
    with pytest.raises(RuntimeError, match="cannot allocate 4 blocks"):
        pool.allocate(4)
    pool.free(blocks)
    pool.check_empty()


def test_double_free_is_an_error():
    pool = BlockPool(4, 4)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        pool.free(blocks)


def test_shared_block_is_released_by_its_last_owner():
    pool = BlockPool(4, 4)
    [b] = pool.allocate(1)
    pool.cache_block(b, 123)
    pool.share([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.num_used == 1
    pool.free([b])
    pool.check_empty()


def test_leak_check_names_the_leaked_blocks():
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    with pytest.raises(AssertionError, match="2 blocks still in use"):
        pool.check_empty()
    pool.free(blocks)


def test_chained_hashes_cover_full_blocks_only_and_depend_on_the_prefix():
    assert len(compute_block_hashes(list(range(11)), 4)) == 2  # the 3-token tail has no hash
    a = compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = compute_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same tokens in block 1, different parents
    assert a[1] == hash_block_tokens(a[0], [5, 6, 7, 8])


def test_cached_blocks_stay_reusable_until_evicted_lru_first():
    pool = BlockPool(num_blocks=4, block_size=4)
    old, new = pool.allocate(2)
    pool.cache_block(old, 111)
    pool.cache_block(new, 222)
    pool.free([old])
    pool.free([new])  # old is now the least recently used
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    assert pool.get_cached_block(111) == old

    plain = pool.allocate(2)  # free uncached blocks go first
    assert set(plain).isdisjoint({old, new}) and pool.get_cached_block(111) == old
    [evicted] = pool.allocate(1)
    assert evicted == old and pool.get_cached_block(111) is None
    assert pool.get_cached_block(222) == new
    pool.free(plain + [evicted])
    pool.check_empty()


def test_sharing_a_cached_block_takes_it_out_of_the_eviction_order():
    pool = BlockPool(2, 4)
    [b] = pool.allocate(1)
    pool.cache_block(b, 7)
    pool.free([b])
    pool.share([b])  # a prefix hit
    assert pool.allocate(1) != [b]
    assert not pool.can_allocate(1)
    pool.free([b])
    pool.free([1 - b])
    pool.check_empty()


def test_an_equal_hash_keeps_the_first_block():
    pool = BlockPool(4, 4)
    first, second = pool.allocate(2)
    assert pool.cache_block(first, 5)
    assert not pool.cache_block(second, 5)
    assert pool.get_cached_block(5) == first
    pool.free([first, second])
    assert pool.num_cached_blocks == 1
    pool.check_empty()


def test_pinned_block_survives_free_and_is_not_reallocated_until_unpinned():
    pool = BlockPool(num_blocks=3, block_size=4)
    blocks = pool.allocate(3)
    pool.pin(blocks[:1])  # an in-flight transfer reads block 0
    pool.free(blocks)
    assert pool.num_free_blocks == 2 and pool.pin_count(blocks[0]) == 1
    again = pool.allocate(2)
    assert blocks[0] not in again and not pool.can_allocate(1)
    pool.unpin(blocks[:1])
    assert pool.allocate(1) == blocks[:1]
    pool.free(again + blocks[:1])
    pool.check_empty()


def test_pinning_a_cached_block_protects_it_from_eviction():
    pool = BlockPool(1, 4)
    [b] = pool.allocate(1)
    pool.cache_block(b, 9)
    pool.free([b])
    pool.pin([b])  # offloading the cached prefix
    assert not pool.can_allocate(1)
    pool.unpin([b])
    assert pool.get_cached_block(9) == b
    pool.check_empty()


def test_pinning_or_unpinning_a_free_block_is_an_error():
    pool = BlockPool(2, 4)
    with pytest.raises(ValueError, match="not allocated"):
        pool.pin([0])
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin([0])


def test_evict_all_cached_returns_blocks_to_the_free_list():
    pool = BlockPool(2, 4)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], 1)
    pool.free(blocks)
    assert pool.evict_all_cached() == 1
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(1) is None
    pool.check_empty()
