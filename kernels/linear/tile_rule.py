"""Which tiles the skinny GEMM (triton_skinny.py) runs: a fixed rule of (N, K, BLOCK_T, SM count, shared memory per
block), so every rank and every restart on one device model runs the same tiles (the same summation order, the same
bits), and nothing is timed at run time: no stall in the first requests, and a new shape's first call may be
captured in a CUDA graph (triton_skinny.py says what capture still needs).

The rule was fit to the H200's graph-replayed times of every K3 rank weight at 1-16 rows
(benchmarks/results/h200-2026-12-01/gpu_linear.json; tests/kernels/test_linear_tile_rule.py checks the picks against
it) and reasons from the machine for shapes not measured; see `tile_order`. `candidates` lists what
benchmarks/gpu_linear.py times beside the rule's pick, to check it on a device."""

from __future__ import annotations

from dataclasses import dataclass

from . import MAX_TRITON_ROWS

BLOCK_N = 64  # weight rows a program: one warpgroup's wgmma at 16 rows of x
MIN_SPLIT_K = 1792  # of K a program streams at least when K is split (224 KB of a 64-row tile's bf16 weight)
_DEEP = (128, 6)  # (BLOCK_K, num_stages): 80-96 KB of weight in flight a program
_WIDE = (256, 4)  # 96-128 KB in flight, in fewer, larger steps
# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried after the pick, each needing less shared memory than either pick;
# the last needs 12 KB, under the 48 KB every CUDA device has.
_FALLBACKS = ((64, 128, 4, 4), (64, 128, 4, 3), (64, 64, 4, 4), (32, 64, 4, 2))


@dataclass(frozen=True)
class Tiles:
    """One launch configuration: BLOCK_N weight rows a program, BLOCK_K a step, `splits` K shares."""

    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"n{self.block_n} k{self.block_k} split{self.splits} w{self.num_warps} s{self.num_stages}"

    def smem_bytes(self, block_t: int) -> int:
        """Shared memory the kernel needs at most: num_stages buffers of a 16-bit weight tile and x tile. Triton 3.6
        for sm_90 allocates exactly this with wgmma (16 rows of x, BLOCK_N 64) and a buffer fewer with mma.sync."""
        return self.num_stages * (self.block_n + block_t) * self.block_k * 2


def block_t(rows: int) -> int:
    """The rows of x a tile holds: 8 up to 8 rows (half the padding), else MAX_TRITON_ROWS."""
    return 8 if rows <= 8 else MAX_TRITON_ROWS


def tile_order(N: int, K: int, block_t: int, sm_count: int, smem_per_block: int) -> list[Tiles]:
    """The tilings to launch for an [N, K] weight, best first: the rule's pick, then fallbacks in a fixed order of
    less shared memory, keeping those within `smem_per_block` (by `Tiles.smem_bytes`; the last fallback if none is).

    - 64 weight rows a program, 4 warps: every K3 weight at 16 rows and all but the lm_head at 8 ran fastest so on
      the H200 (the lm_head's 8-row winner, 32 rows, was no faster than 64 at 16 rows).
    - K is split only where the tiles would leave half the SMs idle or more: into the most equal shares (of the
      128-wide K blocks) that keep programs <= SMs and give each at least MIN_SPLIT_K, so that a split's fixed
      costs (its fp32 partial written and read back, its ticket, its pipeline fill) stay small next to its stream.
      On the H200: MLA's stacked weight (57 tiles) splits in 2, the router-sized one (14) in 4; MLA q_b_proj's 36
      tiles over K = 1536 are too short to split (unsplit won there).
    - K blocks of 128 in 6 stages, except 256 in 4 (more bytes in flight a program: 96-128 KB against 80-96 KB, in
      half the steps) where the programs cover at most half the SMs, each busy SM then pulling a larger share of
      the bandwidth (the router-sized weight), and where two waves of tiles or more queue on every SM (the lm_head
      shard: 256 won there at 8 and at 16 rows; 128 never did, so its time there is unknown). 256 needs K a
      multiple of 256 * splits and MIN_SPLIT_K of K a program (a short loop spends its time filling a 4-deep
      pipeline). Elsewhere the H200's data do not separate the two: where one weight had 128 win at one row count
      and 256 at another, the times were within ~2%.
    The fallbacks keep the pick's splits where their K blocks still divide evenly."""
    tiles = -(-N // BLOCK_N)
    splits = _splits(tiles, K, sm_count)
    programs = tiles * splits
    wide = (K % (_WIDE[0] * splits) == 0 and K // splits >= MIN_SPLIT_K
            and (2 * programs <= sm_count or tiles >= 2 * sm_count))
    block_k, num_stages = _WIDE if wide else _DEEP
    order = [Tiles(BLOCK_N, block_k, splits, 4, num_stages)]
    for n, k, warps, stages in _FALLBACKS:
        order.append(Tiles(n, k, splits if -(-K // k) % splits == 0 else 1, warps, stages))
    return [t for t in order if t.smem_bytes(block_t) <= smem_per_block] or order[-1:]


def _splits(tiles: int, K: int, sm_count: int) -> int:
    """K shares for `tiles` programs: see tile_order."""
    if 2 * tiles > sm_count:
        return 1
    blocks = -(-K // _DEEP[0])
    return max((s for s in range(2, blocks + 1)
                if blocks % s == 0 and tiles * s <= sm_count and K // s >= MIN_SPLIT_K), default=1)


# (BLOCK_N, BLOCK_K, num_warps, num_stages) benchmarks/gpu_linear.py times: each won some K3 shape on the H200 when
# tiles were timed per shape (benchmarks/results/h200-2026-12-01/gpu_linear.log; 32 x 128 only where linear keeps
# cuBLAS: the 1536 x 128 f_b_proj, the router's fp32 logits). The rule picks one of the two 64-row ones.
_BASES = ((32, 256, 4, 4), (64, 256, 4, 4), (64, 128, 4, 6), (32, 128, 4, 6))
_MAX_PROGRAMS_PER_SM = 4  # split no further than this many programs an SM
_MIN_BLOCKS_PER_SPLIT = 2  # each split streams at least two K blocks


def candidates(N: int, K: int, sm_count: int) -> list[Tiles]:
    """The configurations benchmarks/gpu_linear.py times for an [N, K] weight: every base unsplit, and split into
    each count of equal K shares of at least _MIN_BLOCKS_PER_SPLIT blocks that keeps the programs under
    _MAX_PROGRAMS_PER_SM an SM."""
    found = []
    for block_n, block_k, num_warps, num_stages in _BASES:
        tiles, blocks = -(-N // block_n), -(-K // block_k)
        for splits in range(1, blocks + 1):
            if splits == 1 or (blocks % splits == 0 and blocks // splits >= _MIN_BLOCKS_PER_SPLIT
                               and tiles * splits <= _MAX_PROGRAMS_PER_SM * sm_count):
                found.append(Tiles(block_n, block_k, splits, num_warps, num_stages))
    return found
