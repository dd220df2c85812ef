"""StatePool: KDA state slot ids. Working slots, checkpoint slots owned by the prefix cache, pins."""

import pytest

from k3serve.engine.state_pool import StatePool


def test_allocate_free_and_leak_check():
    pool = StatePool(num_slots=3)
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free == 0 and pool.usage == 1.0
    with pytest.raises(RuntimeError, match="all 3 are in use"):
        pool.allocate()
    with pytest.raises(AssertionError, match="3 slots still in use"):
        pool.check_empty()
    for slot in slots:
        pool.free(slot)
    pool.check_empty()
    with pytest.raises(ValueError, match="double free"):
        pool.free(slots[0])


def test_pinned_slot_survives_free_and_is_not_reallocated_until_unpinned():
    pool = StatePool(num_slots=2)
    boundary = pool.allocate()
    pool.pin(boundary)  # the boundary state is being written to the decode peer
    pool.free(boundary)  # the request finished
    assert pool.num_free == 1 and pool.pin_count(boundary) == 1
    other = pool.allocate()
    assert other != boundary and not pool.can_allocate()
    pool.unpin(boundary)
    assert pool.allocate() == boundary
    pool.free(boundary)
    pool.free(other)
    pool.check_empty()


def test_two_pins_need_two_unpins():
    pool = StatePool(1)
    slot = pool.allocate()
    pool.pin(slot)
    pool.pin(slot)  # two ranks still writing
    pool.free(slot)
    pool.unpin(slot)
    assert not pool.can_allocate()
    pool.unpin(slot)
    pool.check_empty()


def test_checkpoints_stay_reusable_and_are_evicted_lru_first():
    pool = StatePool(num_slots=3)
    old, new = pool.allocate(), pool.allocate()
    assert pool.cache_checkpoint(old, key=10)
    assert pool.cache_checkpoint(new, key=20)
    pool.free(old)
    pool.free(new)
    assert pool.num_free == 3 and pool.num_cached == 2
    assert pool.lookup(10) == old

    plain = pool.allocate()  # the never-used slot goes first
    assert plain not in (old, new)
    assert pool.allocate() == old and pool.lookup(10) is None  # LRU checkpoint evicted
    assert pool.lookup(20) == new
    pool.free(plain)
    pool.free(old)
    pool.check_empty()


def test_a_checkpoint_held_by_a_hit_or_a_pin_is_not_evicted():
    pool = StatePool(num_slots=2)
    ckpt = pool.allocate()
    pool.cache_checkpoint(ckpt, key=1)
    pool.free(ckpt)
    pool.share(ckpt)  # a prefix hit is copying it this step
    work = pool.allocate()
    assert work != ckpt and not pool.can_allocate()
    pool.free(ckpt)
    pool.pin(ckpt)  # offloading it to the cache tier
    assert not pool.can_allocate()
    pool.unpin(ckpt)
    assert pool.lookup(1) == ckpt and pool.num_cached == 1
    pool.free(work)
    pool.check_empty()


def test_an_equal_checkpoint_key_keeps_the_first_slot():
    pool = StatePool(2)
    a, b = pool.allocate(), pool.allocate()
    assert pool.cache_checkpoint(a, 5)
    assert not pool.cache_checkpoint(b, 5)
    pool.free(a)
    pool.free(b)
    assert pool.num_cached == 1 and pool.lookup(5) == a
    assert pool.evict_all_cached() == 1 and pool.lookup(5) is None
    pool.check_empty()


def test_bad_pin_share_and_cache_calls_are_errors():
    pool = StatePool(2)
    with pytest.raises(ValueError, match="not allocated"):
        pool.pin(0)
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin(0)
    with pytest.raises(ValueError, match="holds no checkpoint"):
        pool.share(0)
    with pytest.raises(ValueError, match="not in use"):
        pool.cache_checkpoint(0, 1)
    with pytest.raises(ValueError, match="num_slots >= 1"):
        StatePool(0)


def test_forget_drops_a_checkpoint_cached_or_in_use():
    pool = StatePool(3)
    cached, held = pool.allocate(), pool.allocate()
    assert pool.cache_checkpoint(cached, key=1) and pool.cache_checkpoint(held, key=2)
    pool.free(cached)
    assert pool.forget(1) and pool.lookup(1) is None and pool.num_cached == 0
    assert pool.forget(2) and pool.lookup(2) is None  # its holder keeps it until it frees it
    assert not pool.forget(2)
    pool.free(held)
    pool.check_empty()
