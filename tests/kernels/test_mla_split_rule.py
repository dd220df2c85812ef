"""The paged MLA decode's split rule (kernels/mla/split_rule.py) on the CPU: the programs of a launch fit in whole
waves of an H200's 132 SMs, every page of the longest sequence belongs to exactly one non-empty split, and an
explicit split count is taken as asked (rounded to whole pages)."""

from __future__ import annotations

import pytest

from k3serve.kernels.mla.split_rule import DEFAULT_WAVES, MIN_PAGES_PER_SPLIT, split_plan

H200_SMS = 132
PAGE = 64


def _pages(ctx: int) -> int:
    return -(-ctx // PAGE)


@pytest.mark.parametrize(("N", "ctx", "waves", "splits"), [
    (16, 8192, None, 16),  # 2 waves of 8 pages: 256 programs
    (16, 8192, 1, 8),  # one whole wave of 16 pages: 128 programs (ceil gave 9: 144, a second wave of 12)
    (64, 8192, None, 4),  # two waves: 256 programs (ceil gave 3 at one wave: 192, 1.45 waves)
    (64, 8192, 1, 2),  # one wave: 128 programs
    (16, 32768, None, 16),
    (4, 32768, None, 64),  # 66 fit; 8 pages a split cover 512 pages in 64
    (1, 32768, None, 256),  # batch 1: 264 fit, capped at two pages a split
    (1, 32768, 1, 128),  # one wave of one sequence: 132 fit, 4 pages a split cover 512 pages in 128
])
def test_k3_rank_shapes_fill_whole_waves(N: int, ctx: int, waves: int | None, splits: int) -> None:
    """K3 at TP8 (12 heads: one head group) at the shapes benchmarks/gpu_mla.py --sweep times."""
    num_splits, pages_per_split = split_plan(N, 1, _pages(ctx), H200_SMS, waves)
    assert num_splits == splits
    assert N * num_splits <= (waves or DEFAULT_WAVES) * H200_SMS


@pytest.mark.parametrize("head_groups", [1, 2, 4, 8])
@pytest.mark.parametrize("waves", [None, 1, 2, 4])
def test_programs_never_spill_into_another_wave(head_groups: int, waves: int | None) -> None:
    """For every batch whose (sequence, head group) pairs fit in the waves, and every context length up to 64K: the
    grid fits in the waves, splits hold at least MIN_PAGES_PER_SPLIT pages (unless the sequence is shorter), and
    the longest sequence's pages are covered by the splits with none left empty."""
    for N in range(1, 200):
        budget = (waves or DEFAULT_WAVES) * H200_SMS
        for max_pages in (*range(0, 40), 127, 128, 129, 511, 512, 513, 1024):
            num_splits, per_split = split_plan(N, head_groups, max_pages, H200_SMS, waves)
            case = f"N{N} groups {head_groups} pages {max_pages} waves {waves}: {num_splits} x {per_split}"
            assert num_splits >= 1, case
            if N * head_groups <= budget:
                assert N * head_groups * num_splits <= budget, case
            else:
                assert num_splits == 1, case
            assert per_split >= min(MIN_PAGES_PER_SPLIT, max(max_pages, 1)), case
            assert (num_splits - 1) * per_split < max(max_pages, 1) <= num_splits * per_split, case


def test_explicit_split_count_is_rounded_to_whole_pages_only() -> None:
    """An asked count runs as asked where it divides the pages into whole splits, else the fewest splits of the
    same length (never more than asked); waves are then ignored."""
    assert split_plan(16, 1, 128, H200_SMS, num_splits=7) == (7, 19)
    assert split_plan(16, 1, 128, H200_SMS, waves=4, num_splits=9) == (9, 15)
    assert split_plan(16, 1, 128, H200_SMS, num_splits=12) == (12, 11)
    assert split_plan(1, 1, 4, H200_SMS, num_splits=3) == (2, 2)
    assert split_plan(1, 1, 4, H200_SMS, num_splits=64) == (4, 1)


def test_bad_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="num_splits"):
        split_plan(4, 1, 128, H200_SMS, num_splits=0)
    with pytest.raises(ValueError, match="waves"):
        split_plan(4, 1, 128, H200_SMS, waves=-1)
    with pytest.raises(ValueError, match="positive sizes"):
        split_plan(0, 1, 128, H200_SMS)
