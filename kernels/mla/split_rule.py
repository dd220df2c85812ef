"""How the paged MLA decode (triton_decode.py) is launched: heads a program, pipeline stages, and how many KV
splits — a rule of the batch, the head groups, the longest sequence's pages and the SM count, kept apart from the
kernel so the CPU suite checks it without triton.

The grid runs in waves of `num_sm` programs. The splits are the largest count whose N x head_groups x splits
programs fit in `waves` whole waves (floor, not ceil: a ceil spilled a few programs into one more, partly empty
wave, e.g. N64 with 3 splits ran 192 programs, 1.45 waves, on 132 SMs). A wave here is one program an SM: a
launch whose programs fit two an SM on the chip at once runs two such waves together."""

from __future__ import annotations

MIN_PAGES_PER_SPLIT = 2  # a split shorter than this pays the merge for less than it saves


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_h(num_heads: int) -> int:
    """Heads a program: 16 (the smallest tl.dot operand) up to 16 heads, else 32, sharing each page load."""
    return 16 if num_heads <= 16 else 32


def head_groups(num_heads: int) -> int:
    return _cdiv(num_heads, block_h(num_heads))


TWO_PAGES_SHARED_BYTES = 167944  # 5 stages at 16 heads, L 512 + R 64, page 64 (triton 3.6 for sm_90)


def num_stages(num_heads: int, shared_per_block: int) -> int:
    """Pipeline stages of the page loop. The block-table load takes a stage of its own, so 3 stages buffer a page
    once (94 KB of shared memory, two programs an SM) and 5 keep two pages in flight (168 KB, one program an SM).
    16-head groups run 5 where a block may have that much shared memory (an H100/H200/B200, not an A100): one wave
    of them beat two waves of 3-stage programs on an H200 (`gpu_mla.py --sweep`, in graph; the timings:
    docs/BENCHMARKS.md). 32-head groups (registers for [32, 512] fp32 sums) keep 2."""
    if block_h(num_heads) == 32:
        return 2
    return 5 if shared_per_block >= TWO_PAGES_SHARED_BYTES else 3


def default_waves(num_stages: int) -> int:
    """Waves of programs the splits fill: as many as fit on the chip at once, which the stages' shared memory
    decides (see `num_stages`)."""
    return 1 if num_stages >= 5 else 2


def split_plan(num_seqs: int, head_groups: int, max_pages: int, num_sm: int, waves: int,
               num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, pages_per_split) of a launch over num_seqs x head_groups (sequence, head group) pairs whose
    longest sequence has max_pages pages. num_splits None picks floor(waves x num_sm / pairs), at least 1, at most
    one split a MIN_PAGES_PER_SPLIT pages; a given num_splits is taken as asked. Either is then rounded to whole
    pages per split, which never raises the count (ceil(P / ceil(P / s)) <= s) and leaves no split empty at the
    longest sequence, so pairs x num_splits <= waves x num_sm whenever pairs <= waves x num_sm."""
    if min(num_seqs, head_groups, num_sm) < 1 or max_pages < 0:
        raise ValueError(f"split_plan needs positive sizes, got N={num_seqs} groups={head_groups} "
                         f"pages={max_pages} SMs={num_sm}")
    if num_splits is not None and num_splits < 1 or waves < 1:
        raise ValueError(f"num_splits and waves must be >= 1, got {num_splits} and {waves}")
    max_pages = max(max_pages, 1)
    if num_splits is None:
        fit = max(1, waves * num_sm // (num_seqs * head_groups))
        num_splits = min(fit, max(1, _cdiv(max_pages, MIN_PAGES_PER_SPLIT)))
    pages_per_split = _cdiv(max_pages, num_splits)
    return _cdiv(max_pages, pages_per_split), pages_per_split
