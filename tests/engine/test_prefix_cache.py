"""PrefixCache: a hit needs cached MLA blocks AND a KDA checkpoint at the same boundary."""

import pytest

from k3serve.engine.block_pool import BlockPool, compute_block_hashes
from k3serve.engine.prefix_cache import PrefixCache
from k3serve.engine.state_pool import StatePool

BLOCK = 4


@pytest.fixture
def cache():
    block_pool, state_pool = BlockPool(16, BLOCK), StatePool(4)
    yield PrefixCache(block_pool, state_pool)
    block_pool.check_empty()
    state_pool.check_empty()


def compute_and_checkpoint(cache, tokens, boundary):
    """What a request does: hold blocks for `tokens`, checkpoint at `boundary`, then finish."""
    blocks = cache.block_pool.allocate(-(-len(tokens) // BLOCK))
    slot = cache.state_pool.allocate()
    kept = cache.insert(compute_block_hashes(tokens, BLOCK), blocks, boundary, slot)
    cache.block_pool.free(blocks)
    cache.state_pool.free(slot)
    return blocks, slot, kept


def test_hit_at_a_checkpointed_boundary(cache):
    tokens = list(range(10))
    blocks, slot, kept = compute_and_checkpoint(cache, tokens, boundary=8)
    assert kept
    num_hit_tokens, block_ids, checkpoint_slot = cache.lookup(tokens + [99])
    assert (num_hit_tokens, block_ids, checkpoint_slot) == (8, blocks[:2], slot)
    assert (cache.num_lookups, cache.num_hits) == (1, 1)


def test_no_hit_without_a_checkpoint_even_if_blocks_are_cached(cache):
    tokens = list(range(12))
    blocks = cache.block_pool.allocate(3)
    for block_id, block_hash in zip(blocks, compute_block_hashes(tokens, BLOCK)):
        cache.block_pool.cache_block(block_id, block_hash)
    cache.block_pool.free(blocks)
    assert cache.lookup(tokens + [1]) == (0, [], -1)


def test_hit_is_strictly_shorter_than_the_tokens(cache):
    tokens = list(range(8))
    compute_and_checkpoint(cache, tokens, boundary=8)
    assert cache.lookup(tokens).num_tokens == 0  # the identical 8 tokens: one must be computed
    assert cache.lookup(tokens + [5]).num_tokens == 8


def test_hit_takes_the_last_checkpointed_boundary(cache):
    tokens = list(range(16))
    compute_and_checkpoint(cache, tokens[:5], boundary=4)
    _, slot, _ = compute_and_checkpoint(cache, tokens, boundary=12)
    hit = cache.lookup(tokens + [0])
    assert hit.num_tokens == 12 and hit.checkpoint_slot == slot


def test_different_prefix_misses(cache):
    compute_and_checkpoint(cache, list(range(9)), boundary=8)
    assert cache.lookup([7] + list(range(1, 9)) + [0]).num_tokens == 0


def test_evicted_block_breaks_the_chain(cache):
    tokens = list(range(9))
    blocks, _, _ = compute_and_checkpoint(cache, tokens, boundary=8)
    cache.block_pool.allocate(16)  # needs every block: evicts the cached ones
    cache.block_pool.free(list(range(16)))
    assert cache.lookup(tokens).num_tokens == 0


def test_evicted_checkpoint_ends_the_hit(cache):
    tokens = list(range(9))
    compute_and_checkpoint(cache, tokens, boundary=8)
    slots = [cache.state_pool.allocate() for _ in range(4)]
    for slot in slots:
        cache.state_pool.free(slot)
    assert cache.lookup(tokens).num_tokens == 0


def test_duplicate_insert_keeps_the_first_checkpoint(cache):
    tokens = list(range(9))
    _, first, kept_first = compute_and_checkpoint(cache, tokens, boundary=8)
    _, second, kept_second = compute_and_checkpoint(cache, tokens, boundary=8)
    assert kept_first and not kept_second
    assert cache.lookup(tokens).checkpoint_slot == first
    assert cache.state_pool.num_cached == 1


def test_has_boundary_and_clear(cache):
    tokens = list(range(9))
    hashes = compute_block_hashes(tokens, BLOCK)
    assert not cache.has_boundary(hashes, 8)
    compute_and_checkpoint(cache, tokens, boundary=8)
    assert cache.has_boundary(hashes, 8) and not cache.has_boundary(hashes, 4)
    cache.clear()
    assert not cache.has_boundary(hashes, 8)
    assert cache.block_pool.num_cached_blocks == 0 and cache.state_pool.num_cached == 0


def test_insert_validates_the_boundary(cache):
    with pytest.raises(ValueError, match="positive multiple of block_size=4"):
        cache.insert([], [], 6, 0)
    with pytest.raises(ValueError, match="needs 2 blocks"):
        cache.insert([1], [0], 8, 0)
