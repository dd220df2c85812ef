"""Per-request checksums of transferred state: did the bytes the decode rank runs from arrive intact?

A byte-exact transfer is not proven by a DONE status (a partial write once reported success, a
slot once moved under a transfer: PD_PRIOR_ART §7.1). So both sides checksum the same thing:
the DECODE rank's view of the request, region by region:

    region              decode rank r's view (bytes in this order)
    mla.{i}             token rows 0..num_tokens-1 of the request's blocks (not the block tails)
    kda_recurrent.{j}   the slot: [H/D heads, K, V]
    kda_conv.{j}        the slot: q | k | v sub-blocks of (H/D)*K channels, W-1 values each

The checksum is ADDITIVE over byte positions of that view, so a prefill rank can compute its
share from its own cache, placed at the offsets its bytes take in the decode view, and the
shares of all sources add up to what the decode rank computes after landing:

    decode r0 view of kda_conv.0   | q: h0 h1 h2 h3 | k: h0 h1 h2 h3 | v: h0 h1 h2 h3 |
    from s0 (heads 0-1)            | ##### ........ | ##### ........ | ##### ........ |
    from s1 (heads 2-3)            | ..... ######## | ..... ######## | ..... ######## |
    combine([s0, s1]) == checksum(view on r0)

The view is read as 16-bit words (every element is >= 2 bytes and every offset in a view is a
multiple of an element size; odd offsets or lengths are refused). Word w (as int16, shifted to
v = w + 32769 in 1..65536, so a zero word still counts) at word position p adds two lanes:

    lane 1: v * (p + 1)  mod p1 = 2^31 - 1 (prime)   a single changed word, or two swapped unequal
                                                     words, ALWAYS change it (views < 4 GiB)
    lane 2: v * R^p      mod p2 = 2^31 - 19 (prime)  polynomial hash, R a primitive root: the rest

Cheap because nothing is reduced per element: the words of all the pieces of a request are
placed, row-aligned, into one float64 matrix X of rows of 1024 words (zero-padded), and one
matmul X @ [1, j+1, R^j & 0xffff, R^j >> 16] gives four exact integer sums per row (every
product and partial sum stays far below 2^53, so any summation order is exact, on any device).
Rows are folded with their position (lane 1) and R^(row start) (lane 2) in int64, summed per
piece, and the piece's offset in the view and the +32769 shift are fixed up with Python ints.
Only one small tensor of per-piece sums reaches the host.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from k3serve.model.batch import ModelCache
from k3serve.transfer.layout import CacheLayout, HeadSlice
from k3serve.transfer.metrics import BoundTransferMetrics

_P1 = 2**31 - 1  # prime: position weights 1..p1-1 are distinct and nonzero
_P2 = 2**31 - 19  # prime
_R = 0x5DEECE6E  # a primitive root mod p2: lane-2 weights R^p repeat only after p2 - 1 words
_R_MINUS_1_INV = pow(_R - 1, -1, _P2)
_SHIFT = 32769  # int16 word w -> w + 32769 in 1..65536
_WORD = 2  # bytes
_ROW = 1024  # words per matrix row: |row sums| < 2^42, exact in float64
_BATCH_WORDS = 1 << 22  # words per matmul: float64 temporaries of 32 MiB at most
_MAX_VIEW_WORDS = _P1 - 2


@dataclass(frozen=True)
class _Piece:
    """Words of one region's view: `words` (int16) at word position `offset` of the view."""

    region: str
    words: torch.Tensor
    offset: int


def region_checksum(tensor_view: torch.Tensor, offset: int = 0) -> str:
    """Checksum of the bytes of `tensor_view` (row-major order), placed at byte `offset` of the view
    being checksummed. Same bytes at the same offset -> same value, on any device and tensor."""
    return _checksum_pieces([_piece("", tensor_view, offset)])[""]


def combine_checksums(parts: Iterable[str]) -> str:
    """The checksum of a view assembled from disjoint parts, each checksummed at its own offset."""
    lane1 = lane2 = 0
    for part in parts:
        a, b = _parse(part)
        lane1, lane2 = (lane1 + a) % _P1, (lane2 + b) % _P2
    return _format(lane1, lane2)


def request_checksums(
    cache: ModelCache,
    layout: CacheLayout,
    block_ids: Sequence[int],
    slot_id: int,
    num_tokens: int,
    heads: HeadSlice | None,
    include_mla: bool = True,
) -> dict[str, str]:
    """Checksums, per region, of this cache's share of one decode rank's view of a request.

    Sender (prefill rank s, for decode rank r): `heads` and `include_mla` from `TPMapping.view(s, r)`.
    Receiver (decode rank r): `heads=HeadSlice.whole_shard(layout)`, `include_mla=True`; its
    values equal `combine_request_checksums` of the senders' dicts when the bytes arrived intact.
    All regions are summed in one pass (`_checksum_pieces`).
    """
    pieces: list[_Piece] = []
    if include_mla and cache.mla_kv:
        if num_tokens > len(block_ids) * layout.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {layout.block_size}")
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.mla_kv[0].device)
        for region, kv in zip(layout.mla, cache.mla_kv):
            rows = kv.index_select(0, ids)  # [blocks, block_size, kv_dim]: the request's blocks, gathered once
            pieces.append(_piece(region.name, rows.reshape(-1, rows.shape[-1])[:num_tokens], 0))
    if heads is not None:
        first = layout.tp_rank * layout.num_kda_heads_local
        if not first <= heads.start < heads.stop <= first + layout.num_kda_heads_local:
            raise ValueError(f"heads [{heads.start}, {heads.stop}) are not on rank {layout.tp_rank} of {layout.tp_size}")
        lo, hi = heads.start - first, heads.stop - first  # local heads on this rank
        into_view = heads.start - heads.view_start  # first head's position in the decode view
        k = layout.kda_head_dim
        for region, state in zip(layout.kda_recurrent, cache.kda_recurrent):
            pieces.append(_piece(region.name, state[slot_id, lo:hi], into_view * region.bytes_per_head))
        for region, conv in zip(layout.kda_conv, cache.kda_conv):
            if hi - lo == heads.view_heads == layout.num_kda_heads_local:  # the whole slot, in place
                pieces.append(_piece(region.name, conv[slot_id], 0))
                continue
            for sub in range(3):  # q, k, v sub-blocks, each cut by the same channel range
                rows = conv[slot_id, sub * region.channels_local + lo * k : sub * region.channels_local + hi * k]
                view_row = sub * heads.view_heads * k + into_view * k
                pieces.append(_piece(region.name, rows, view_row * region.bytes_per_channel))
    return _checksum_pieces(pieces)


def combine_request_checksums(shares: Iterable[dict[str, str]]) -> dict[str, str]:
    """Add up the senders' shares, region by region (a region may come from one sender only)."""
    parts: dict[str, list[str]] = {}
    for share in shares:
        for name, value in share.items():
            parts.setdefault(name, []).append(value)
    return {name: combine_checksums(values) for name, values in parts.items()}


def mismatched_regions(
    expected: dict[str, str], landed: dict[str, str], metrics: BoundTransferMetrics | None = None
) -> list[str]:
    """Regions whose landed checksum differs from the expected one, or that only one side has.
    Empty means the request's state arrived intact; anything else must fail the request."""
    bad = sorted(name for name in expected.keys() | landed.keys() if expected.get(name) != landed.get(name))
    if bad and metrics is not None:
        metrics.checksum_mismatch(len(bad))
    return bad


def _piece(region: str, tensor: torch.Tensor, offset: int) -> _Piece:
    """`tensor`'s bytes as int16 words at byte `offset` of a view; ValueError off the word grid."""
    data = tensor.contiguous().reshape(-1)
    nbytes = data.numel() * data.element_size()
    if offset % _WORD or nbytes % _WORD:
        raise ValueError(f"checksummed views are made of {_WORD}-byte words: offset {offset}, {nbytes} bytes")
    if offset < 0 or (offset + nbytes) // _WORD > _MAX_VIEW_WORDS:
        raise ValueError(f"checksummed views must lie in [0, {_MAX_VIEW_WORDS * _WORD}) bytes; got offset {offset} + {nbytes}")
    if data.element_size() == 1:
        data = data.view(torch.uint8)  # bool and fp8 views too
    return _Piece(region, data.view(torch.int16), offset // _WORD)


def _checksum_pieces(pieces: list[_Piece]) -> dict[str, str]:
    """Sum every piece's lanes into its region's (see the module docstring for the scheme)."""
    lanes: dict[str, tuple[int, int]] = {}
    for batch in _batches(pieces):
        for piece, start_row, (s0, b1, v2) in zip(*_row_sums(batch)):
            n, off = piece.words.numel(), piece.offset
            shift = off - start_row * _ROW  # view position - matrix position of every word of the piece
            lane1 = b1 + shift * s0 + _SHIFT * (n * off + n * (n + 1) // 2)
            geometric = (pow(_R, n, _P2) - 1) * _R_MINUS_1_INV
            lane2 = pow(_R, shift, _P2) * v2 + _SHIFT * pow(_R, off, _P2) * geometric
            a, b = lanes.get(piece.region, (0, 0))
            lanes[piece.region] = ((a + lane1) % _P1, (b + lane2) % _P2)
    return {region: _format(*lane) for region, lane in lanes.items()}


def _batches(pieces: list[_Piece]) -> Iterable[list[_Piece]]:
    """Pieces cut to at most one batch each and packed into batches of <= _BATCH_WORDS words of
    whole rows (what one matmul takes)."""
    batch: list[_Piece] = []
    rows = 0
    for piece in pieces:
        for start in range(0, max(piece.words.numel(), 1), _BATCH_WORDS):
            part = _Piece(piece.region, piece.words[start : start + _BATCH_WORDS], piece.offset + start)
            need = -(-part.words.numel() // _ROW)
            if batch and (rows + need) * _ROW > _BATCH_WORDS:
                yield batch
                batch, rows = [], 0
            batch.append(part)
            rows += need
    if batch:
        yield batch


def _row_sums(batch: list[_Piece]) -> tuple[list[_Piece], list[int], list[list[int]]]:
    """One matmul over the batch's words: per piece its first matrix row and three exact sums:
    sum(w), sum(w * (q + 1)) mod p1 and sum(w * R^q) mod p2, with q a word's position in the
    matrix (w the raw int16 value: the shift and the view offset are fixed up by the caller)."""
    device = batch[0].words.device
    starts, rows = [], 0
    for piece in batch:
        starts.append(rows)
        rows += -(-piece.words.numel() // _ROW)
    matrix = torch.empty(rows, _ROW, dtype=torch.float64, device=device)
    flat = matrix.view(-1)
    for piece, start in zip(batch, starts):
        n, at = piece.words.numel(), start * _ROW
        flat[at : at + n].copy_(piece.words)
        if n % _ROW:
            flat[at + n : at + -(-n // _ROW) * _ROW].zero_()  # zero words add nothing to the raw sums
    tables = _tables(device)
    sums = (tables.weights @ matrix.t()).to(torch.int64)  # [4, rows], exact (weights first: 2x faster on CPU)
    lane1 = (sums[1] + tables.row_start[:rows] * sums[0]).remainder_(_P1)
    lane2 = (sums[2].remainder(_P2) + sums[3].remainder(_P2) * 65536).remainder_(_P2)
    lane2 = (lane2 * tables.row_power[:rows]).remainder_(_P2)
    per_row = torch.stack([sums[0], lane1, lane2], dim=1)
    cumulative = torch.cat([per_row.new_zeros(1, 3), per_row.cumsum(0)])  # < 2^43: exact
    bounds = torch.as_tensor(starts + [rows], device=device)
    per_piece = (cumulative[bounds[1:]] - cumulative[bounds[:-1]]).tolist()
    return batch, starts, per_piece


@dataclass(frozen=True)
class _Tables:
    weights: torch.Tensor  # [4, _ROW] float64: 1, j + 1, R^j mod p2 split in 16-bit halves
    row_start: torch.Tensor  # [rows] int64: g * _ROW
    row_power: torch.Tensor  # [rows] int64: R^(g * _ROW) mod p2


_TABLES: dict[torch.device, _Tables] = {}
_TABLES_LOCK = threading.Lock()


def _tables(device: torch.device) -> _Tables:
    """The position weights, built once per device."""
    with _TABLES_LOCK:
        tables = _TABLES.get(device)
        if tables is None:
            powers = [pow(_R, j, _P2) for j in range(_ROW)]
            columns = [[1] * _ROW, [j + 1 for j in range(_ROW)], [p & 0xFFFF for p in powers], [p >> 16 for p in powers]]
            weights = torch.tensor(columns, dtype=torch.float64)
            max_rows = _BATCH_WORDS // _ROW
            step = pow(_R, _ROW, _P2)
            row_power = [1]
            for _ in range(max_rows - 1):
                row_power.append(row_power[-1] * step % _P2)
            tables = _TABLES[device] = _Tables(
                weights.to(device),
                (torch.arange(max_rows, dtype=torch.int64) * _ROW).to(device),
                torch.tensor(row_power, dtype=torch.int64).to(device),
            )
        return tables


def _format(lane1: int, lane2: int) -> str:
    return f"{lane1:08x}{lane2:08x}"


def _parse(value: str) -> tuple[int, int]:
    if len(value) != 16:
        raise ValueError(f"not a k3serve checksum: {value!r}")
    return int(value[:8], 16), int(value[8:], 16)


def flatten_rank_checksums(per_rank: dict[int, dict[str, str]]) -> dict[str, str]:
    """One prefill rank's sums for every decode rank it wrote, as TransferReady carries them:
    {decode rank: {region: sum}} -> {"<decode rank>/<region>": sum}."""
    return {f"{rank}/{name}": value for rank, sums in per_rank.items() for name, value in sums.items()}


def split_rank_checksums(flat: dict[str, str], decode_tp: int) -> dict[int, dict[str, str]]:
    """Inverse of `flatten_rank_checksums`; ValueError for a key that names no decode rank."""
    out: dict[int, dict[str, str]] = {}
    for key, value in flat.items():
        rank, sep, name = key.partition("/")
        if not sep or not rank.isdigit() or not name or int(rank) >= decode_tp:
            raise ValueError(f"checksum key {key!r} is not '<decode rank < {decode_tp}>/<region>'")
        out.setdefault(int(rank), {})[name] = value
    return out
