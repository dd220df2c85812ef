"""The lanes of `transfer/checksum.py`'s pieces on CUDA, in one Triton launch and one host sync.

One program sums one tile of <= TILE words of one piece, read in place from the cache tensor (no gather), and
atomically adds its two lanes, reduced and placed at the tile's view position, into its piece's int64 sums.
Exact: the integer bounds that TILE and BLOCK must keep (`_check_bounds`) are derived in
docs/design/handoff.md §6.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from k3serve.kernels._backend import device_of
from k3serve.transfer.checksum_lanes import _DIGIT, _P1, _P2, _SHIFT, Piece, _powers

TILE = 1 << 14  # words one program sums
BLOCK = 1 << 10  # words one step of a program loads
_COLUMNS = 7  # int64 per piece in the table (see `piece_lanes`)


def _check_bounds() -> None:
    """The exact-integer bounds (docs/design/handoff.md §6) hold only for these sizes (tests shrink them)."""
    if not (TILE <= 1 << 14 and TILE % BLOCK == 0 and BLOCK < 1 << _DIGIT):
        raise ValueError(f"TILE {TILE} / BLOCK {BLOCK} break the kernel's int32/int64 bounds")


@triton.jit(do_not_specialize=["num_pieces"])  # one compiled kernel for any piece count (of one SEARCH_STEPS)
def _piece_lanes_kernel(
    anchor,  # int16 pointer: every word is at anchor + a word offset
    table,  # int64 [num_pieces, COLUMNS] then the run ids: see `piece_lanes`
    powers,  # int64 [3, 2^DIGIT] (`checksum_lanes._powers`): R^i, R^(i * 2^DIGIT), R^(i * 2^(2 * DIGIT)) mod p2
    sums,  # int64 [num_pieces, 2]: lane sums of each piece's tiles (not yet reduced)
    num_pieces,
    SEARCH_STEPS: tl.constexpr,
    COLUMNS: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK: tl.constexpr,
    DIGIT: tl.constexpr,
    SHIFT: tl.constexpr,
    P1: tl.constexpr,
    P2: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    lo = tile * 0  # the piece: the last table row whose first tile <= tile (binary search)
    hi = lo + num_pieces
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(table + mid * COLUMNS) <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    row = table + lo * COLUMNS
    first = tl.load(row + 1)  # word offset from the anchor of the piece's first run, at run id 0
    count = tl.load(row + 2)  # words in the piece
    offset = tl.load(row + 3)  # the piece's first word's position in the view
    run = tl.load(row + 4)  # words a run, and from run id r to run id r + 1 in the source
    runs_at = tl.load(row + 5)  # where the piece's run ids start in `table`
    tiles_per_run = tl.load(row + 6)
    in_piece = tile - tl.load(row)
    k = in_piece // tiles_per_run
    in_run = (in_piece - k * tiles_per_run) * TILE
    start = k * run + in_run  # the tile's first word in the piece
    valid = tl.minimum(tl.minimum(run - in_run, count - start), TILE)
    src = anchor + (first + tl.load(table + runs_at + k) * run + in_run)
    q0 = offset + start

    i = tl.arange(0, BLOCK)
    r_i = tl.load(powers + i)  # R^i mod p2, i < BLOCK
    r_block = tl.load(powers + BLOCK)  # R^BLOCK mod p2
    r_step = q0 * 0 + 1  # R^(step start) mod p2
    acc0 = tl.zeros([BLOCK], dtype=tl.int32)
    acc1 = tl.zeros([BLOCK], dtype=tl.int64)
    lane2 = q0 * 0
    for step in range(0, TILE, BLOCK):
        j = step + i
        mask = j < valid
        w = tl.load(src + j, mask=mask, other=0).to(tl.int32)
        v = tl.where(mask, w + SHIFT, 0)
        acc0 += v
        acc1 += (v * (j + 1)).to(tl.int64)
        step_sum = tl.sum(v.to(tl.int64) * r_i, axis=0) % P2
        lane2 = (lane2 + step_sum * r_step) % P2
        r_step = r_step * r_block % P2
    lane1 = (q0 * tl.sum(acc0.to(tl.int64), axis=0) + tl.sum(acc1, axis=0)) % P1
    mask_digit = (1 << DIGIT) - 1
    lane2 = lane2 * tl.load(powers + (q0 & mask_digit)) % P2
    lane2 = lane2 * tl.load(powers + (1 << DIGIT) + ((q0 >> DIGIT) & mask_digit)) % P2
    lane2 = lane2 * tl.load(powers + (2 << DIGIT) + (q0 >> (2 * DIGIT))) % P2
    tl.atomic_add(sums + lo * 2, lane1)
    tl.atomic_add(sums + lo * 2 + 1, lane2)


def piece_lanes(pieces: Sequence[Piece]) -> list[tuple[int, int]]:
    """(lane 1, lane 2) of every piece, all of one device: one launch, one host sync.

    Table row of a piece (int64): first tile, first word (from the anchor), words, view position,
    words a run, where its run ids start in the table, tiles a run; run ids follow the rows."""
    _check_bounds()
    device = pieces[0].source.device
    if any(piece.source.device != device for piece in pieces):
        raise ValueError("all pieces of one checksum pass must live on one device")
    powers = _powers(device)
    anchor = powers.view(torch.int16)  # any int16 tensor of the device anchors the word offsets: a cached one
    anchor_ptr = anchor.data_ptr()
    summed = [i for i, piece in enumerate(pieces) if piece.count]
    rows: list[int] = []
    run_ids: list[int] = []
    run_table_at: dict[tuple[int, ...], int] = {}
    tiles = 0
    for i in summed:
        piece = pieces[i]
        runs_at = run_table_at.get(piece.runs)
        if runs_at is None:
            runs_at = run_table_at[piece.runs] = len(summed) * _COLUMNS + len(run_ids)
            run_ids.extend(piece.runs)
        tiles_per_run = -(-piece.run // TILE)
        full_runs, rest = divmod(piece.count, piece.run)
        first = (piece.source.data_ptr() - anchor_ptr) // 2 + piece.first
        rows += [tiles, first, piece.count, piece.offset, piece.run, runs_at, tiles_per_run]
        tiles += full_runs * tiles_per_run + -(-rest // TILE)
    lanes = [(0, 0)] * len(pieces)
    if not tiles:
        return lanes
    table = torch.tensor(rows + run_ids, dtype=torch.int64, device=device)  # a few KB; the result syncs anyway
    sums = torch.zeros(len(summed), 2, dtype=torch.int64, device=device)
    with device_of(anchor):  # CPU tensors: the Triton interpreter (tests)
        _piece_lanes_kernel[(tiles,)](
            anchor, table, powers, sums, len(summed),
            SEARCH_STEPS=max(1, len(summed).bit_length()), COLUMNS=_COLUMNS, TILE=TILE, BLOCK=BLOCK, DIGIT=_DIGIT,
            SHIFT=_SHIFT, P1=_P1, P2=_P2, num_warps=4,
        )  # fmt: skip
    for i, (a, b) in zip(summed, sums.tolist()):
        lanes[i] = (a % _P1, b % _P2)
    return lanes
