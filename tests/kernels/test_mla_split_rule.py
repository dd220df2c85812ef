"""The paged MLA decode's launch rule (kernels/mla/split_rule.py) on the CPU: K3's 12-head groups keep two pages in
flight (5 stages, one program an SM) and split for one wave; the programs of a launch fit in whole waves of an
H200's 132 SMs, every page of the longest sequence belongs to exactly one non-empty split, and an explicit split
count is taken as asked (rounded to whole pages)."""

from __future__ import annotations

import pytest

from k3serve.kernels.mla.split_rule import MIN_PAGES_PER_SPLIT, block_h, default_waves, num_stages, split_plan

H200_SMS = 132
H200_SHARED, A100_SHARED = 232448, 166912  # shared memory a block may opt into
PAGE = 64


def _pages(ctx: int) -> int:
    return -(-ctx // PAGE)


def test_k3_rank_heads_keep_two_pages_in_flight_on_one_wave() -> None:
    """On an H200: 12 heads (K3 at TP8) and 16: one 16-head group, 5 stages, one wave; 128 heads: 32-head groups, 2
    stages (the [32, 512] sums leave no registers for more), two waves of programs that fit two an SM."""
    plans = [(block_h(h), num_stages(h, H200_SHARED), default_waves(num_stages(h, H200_SHARED))) for h in (12, 16, 128)]
    assert plans == [(16, 5, 1), (16, 5, 1), (32, 2, 2)]


def test_without_the_shared_memory_for_two_pages_one_page_is_in_flight() -> None:
    """An A100 (163 KB a block) cannot launch the 168 KB programs: 3 stages, two programs an SM, two waves."""
    assert num_stages(12, A100_SHARED) == 3 and default_waves(3) == 2


@pytest.mark.parametrize(("N", "ctx", "waves", "splits"), [
    (16, 8192, 1, 8),  # one whole wave of 16 pages: 128 programs (ceil gave 9: 144, a second wave of 12)
    (16, 8192, 2, 16),  # 2 waves of 8 pages: 256 programs
    (64, 8192, 1, 2),  # one wave: 128 programs
    (64, 8192, 2, 4),  # two waves: 256 programs (ceil gave 3 at one wave: 192, 1.45 waves)
    (16, 32768, 1, 8),
    (4, 32768, 1, 32),  # 33 fit; 16 pages a split cover 512 pages in 32
    (4, 32768, 2, 64),  # 66 fit; 8 pages a split cover 512 pages in 64
    (1, 32768, 1, 128),  # one wave of one sequence: 132 fit, 4 pages a split cover 512 pages in 128
    (1, 32768, 2, 256),  # 264 fit, capped at two pages a split
])
def test_k3_rank_shapes_fill_whole_waves(N: int, ctx: int, waves: int, splits: int) -> None:
    """K3 at TP8 (12 heads: one head group) at the shapes benchmarks/gpu_mla.py --sweep times."""
    num_splits, pages_per_split = split_plan(N, 1, _pages(ctx), H200_SMS, waves)
    assert num_splits == splits
    assert N * num_splits <= waves * H200_SMS


@pytest.mark.parametrize("head_groups", [1, 2, 4, 8])
@pytest.mark.parametrize("waves", [1, 2, 4])
def test_programs_never_spill_into_another_wave(head_groups: int, waves: int | None) -> None:
    """For every batch whose (sequence, head group) pairs fit in the waves, and every context length up to 64K: the
    grid fits in the waves, splits hold at least MIN_PAGES_PER_SPLIT pages (unless the sequence is shorter), and
    the longest sequence's pages are covered by the splits with none left empty."""
    for N in range(1, 200):
        budget = waves * H200_SMS
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
    assert split_plan(16, 1, 128, H200_SMS, 1, num_splits=7) == (7, 19)
    assert split_plan(16, 1, 128, H200_SMS, waves=4, num_splits=9) == (9, 15)
    assert split_plan(16, 1, 128, H200_SMS, 2, num_splits=12) == (12, 11)
    assert split_plan(1, 1, 4, H200_SMS, 1, num_splits=3) == (2, 2)
    assert split_plan(1, 1, 4, H200_SMS, 1, num_splits=64) == (4, 1)


def test_bad_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="num_splits"):
        split_plan(4, 1, 128, H200_SMS, 1, num_splits=0)
    with pytest.raises(ValueError, match="waves"):
        split_plan(4, 1, 128, H200_SMS, waves=-1)
    with pytest.raises(ValueError, match="positive sizes"):
        split_plan(0, 1, 128, H200_SMS, 1)
