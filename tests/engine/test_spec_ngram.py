"""Specification: prompt lookup proposes what followed the first earlier occurrence of the longest suffix n-gram
(prompt_lookup_min <= n <= prompt_lookup_max), from an index that grows by the tokens a request gains."""

from __future__ import annotations

import pytest

from k3serve.engine.spec.ngram import NgramIndex, NgramProposer


def test_the_longest_suffix_match_wins_and_its_first_occurrence_is_used() -> None:
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 9, 2, 3, 7, 1, 2, 3])
    assert index.propose(3) == [9, 2, 3]  # [1, 2, 3] occurred at 0: what followed it
    index.extend([5])
    assert index.propose(4) == []  # 5 never occurred before
    index.extend([2, 3])
    assert index.propose(2) == [9, 2]  # [5, 2, 3] never occurred; [2, 3] first at 1, followed by 9, 2
    assert NgramIndex(2, 3).propose(1) == []


def test_short_matches_below_prompt_lookup_min_propose_nothing() -> None:
    index = NgramIndex(2, 4)
    index.extend([4, 8, 6, 8])
    assert index.propose(3) == []  # only the 1-gram [8] recurs
    index.extend([6])
    assert index.propose(3) == [8, 6]  # [8, 6] first at 1: what followed it, up to the present


def test_the_proposer_feeds_each_request_only_its_new_tokens_and_forgets_it_on_release() -> None:
    proposer = NgramProposer(num_speculative_tokens=2, min_n=1, max_n=2)
    assert proposer.propose("a", [1, 2, 3, 1], 8) == [2, 3]  # at most K
    assert proposer.propose("a", [1, 2, 3, 1, 2], 1) == [3]
    with pytest.raises(ValueError, match="fewer than"):
        proposer.propose("a", [1], 1)
    proposer.release("a")
    assert proposer.num_indexed == 0
