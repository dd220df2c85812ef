"""How many KV splits the paged MLA decode (triton_decode.py) runs: a rule of the batch, the head groups, the
longest sequence's pages and the SM count, kept apart from the kernel so the CPU suite checks it without triton.

A decode program holds a 64-row page tile of 576 bf16 columns in each of its 2-3 pipeline stages, so an H200 SM
runs one program at a time: the grid runs in waves of `num_sm` programs. The splits are the largest count whose
N x head_groups x splits programs fit in `waves` whole waves (floor, not ceil: a ceil spilled a few programs into
one more, nearly empty wave, e.g. N64 with 3 splits ran 192 programs, 1.45 waves, on 132 SMs)."""

from __future__ import annotations

MIN_PAGES_PER_SPLIT = 2  # a split shorter than this pays the merge for less than it saves


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_h(num_heads: int) -> int:
    """Heads a program: 16 (the smallest tl.dot operand) up to 16 heads, else 32, sharing each page load."""
    return 16 if num_heads <= 16 else 32


def head_groups(num_heads: int) -> int:
    return _cdiv(num_heads, block_h(num_heads))


def default_waves(num_seqs: int, head_groups: int) -> int:
    """One wave once 64+ (sequence, head group) pairs fill the GPU nearly by themselves, else two (the H200 sweep of
    2026-11-30: 2 waves of 8 pages beat 1.09 waves of 15 at N16 ctx8K, 60 vs 69 us)."""
    return 1 if num_seqs * head_groups >= 64 else 2


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
        waves = waves or default_waves(num_seqs, head_groups)
        fit = max(1, waves * num_sm // (num_seqs * head_groups))
        num_splits = min(fit, max(1, _cdiv(max_pages, MIN_PAGES_PER_SPLIT)))
    pages_per_split = _cdiv(max_pages, num_splits)
    return _cdiv(max_pages, pages_per_split), pages_per_split
