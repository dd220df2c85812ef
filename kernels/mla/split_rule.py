"""How many KV splits the paged MLA decode (triton_decode.py) runs: a rule of the batch, the head groups, the
longest sequence's pages and the SM count, kept apart from the kernel so the CPU suite checks it without triton.

The grid runs in waves of `num_sm` programs. The splits are the largest count whose N x head_groups x splits
programs fit in `waves` whole waves (floor, not ceil: a ceil spilled a few programs into one more, partly empty
wave, e.g. N64 with 3 splits ran 192 programs, 1.45 waves, on 132 SMs)."""

from __future__ import annotations

MIN_PAGES_PER_SPLIT = 2  # a split shorter than this pays the merge for less than it saves
# Two whole waves at every batch: the H200 sweep of 2026-12-01 (in graph; gpu_mla_sweep.log in
# benchmarks/results/h200-2026-12-01c) timed them fastest at N16 ctx8K (51.6 us vs 59.2 on one wave), N64 ctx8K
# (157.7 vs 204.6: 91% of copy bandwidth), N16 and N4 ctx32K; only one sequence of 32K ran faster on one wave
# (28.0 vs 32.1 us).
DEFAULT_WAVES = 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_h(num_heads: int) -> int:
    """Heads a program: 16 (the smallest tl.dot operand) up to 16 heads, else 32, sharing each page load."""
    return 16 if num_heads <= 16 else 32


def head_groups(num_heads: int) -> int:
    return _cdiv(num_heads, block_h(num_heads))


def split_plan(num_seqs: int, head_groups: int, max_pages: int, num_sm: int, waves: int | None = None,
               num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, pages_per_split) of a launch over num_seqs x head_groups (sequence, head group) pairs whose
    longest sequence has max_pages pages. num_splits None picks floor(waves x num_sm / pairs), at least 1, at most
    one split a MIN_PAGES_PER_SPLIT pages; a given num_splits is taken as asked. Either is then rounded to whole
    pages per split, which never raises the count (ceil(P / ceil(P / s)) <= s) and leaves no split empty at the
    longest sequence, so pairs x num_splits <= waves x num_sm whenever pairs <= waves x num_sm."""
    if min(num_seqs, head_groups, num_sm) < 1 or max_pages < 0:
        raise ValueError(f"split_plan needs positive sizes, got N={num_seqs} groups={head_groups} "
                         f"pages={max_pages} SMs={num_sm}")
    if num_splits is not None and num_splits < 1 or waves is not None and waves < 1:
        raise ValueError(f"num_splits and waves must be >= 1, got {num_splits} and {waves}")
    max_pages = max(max_pages, 1)
    if num_splits is None:
        waves = waves or DEFAULT_WAVES
        fit = max(1, waves * num_sm // (num_seqs * head_groups))
        num_splits = min(fit, max(1, _cdiv(max_pages, MIN_PAGES_PER_SPLIT)))
    pages_per_split = _cdiv(max_pages, num_splits)
    return _cdiv(max_pages, pages_per_split), pages_per_split
