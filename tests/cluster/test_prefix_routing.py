"""PrefixRouting: the replica that holds a prompt's longest unit is cheapest, unless its load outweighs the hit; with
a shared store every replica holds what any of them wrote through."""

import pytest

from k3serve.cluster.prefix_routing import PrefixRouting

BLOCK = 4
FIRST = list(range(1, 11))  # its unit: 8 tokens (2 blocks)
SECOND = FIRST + [50, 51, 52, 53, 54]  # extends it: a hit of 8 where FIRST ran


def test_the_replica_that_ran_a_prefix_is_preferred_over_the_tie_break():
    routing = PrefixRouting(BLOCK)
    routing.record("b", FIRST)
    assert routing.hit_tokens("b", routing.hashes(SECOND)) == 8
    assert routing.hit_tokens("a", routing.hashes(SECOND)) == 0
    assert routing.order(["a", "b"], SECOND, {}) == ["b", "a"]


def test_a_hit_is_weighed_against_the_tokens_in_flight():
    routing = PrefixRouting(BLOCK)
    routing.record("b", FIRST)
    assert routing.order(["a", "b"], SECOND, {"b": 7}) == ["b", "a"]  # 7 + 15 - 8 < 15
    assert routing.order(["a", "b"], SECOND, {"b": 9}) == ["a", "b"]  # 9 + 15 - 8 > 15
    assert routing.order(["a", "b"], SECOND, {"b": 8}) == ["a", "b"]  # equal: the tie-break order


def test_a_shared_store_serves_every_replica_and_a_forgotten_replica_holds_nothing():
    routing = PrefixRouting(BLOCK, shared_store=True)
    routing.record("b", FIRST)
    routing.forget("b")
    assert routing.hit_tokens("a", routing.hashes(SECOND)) == 8 == routing.hit_tokens("b", routing.hashes(SECOND))
    assert PrefixRouting(BLOCK).hit_tokens("b", PrefixRouting(BLOCK).hashes(SECOND)) == 0


def test_a_hit_is_strictly_shorter_than_the_prompt_and_units_are_lru_bounded():
    routing = PrefixRouting(BLOCK, max_units=1)
    routing.record("a", FIRST)
    assert routing.hit_tokens("a", routing.hashes(FIRST[:8])) == 0  # the unit's own 8 tokens: one must be computed
    assert routing.hit_tokens("a", routing.hashes(FIRST[:9])) == 8
    routing.record("a", [9, 9, 9, 9, 9, 9])
    assert routing.hit_tokens("a", routing.hashes(SECOND)) == 0  # FIRST's unit evicted
    with pytest.raises(ValueError):
        PrefixRouting(0)
