"""Per-request checksums of transferred state: did the bytes the decode rank runs from arrive intact?

Both sides checksum the decode rank's view of a request, region by region (MLA token rows 0..num_tokens-1 of its
blocks, its KDA slot's heads of that rank), read as 16-bit words into two lanes mod two primes. The sum is
additive over byte positions, so each prefill rank checksums its share from its own cache, placed where its
bytes land in the decode view, and `combine_request_checksums` of the shares equals the landed view's sum.
Values are exact on every device: the float64 matmul here on CPU, one Triton kernel reading the cache in place
on CUDA (`checksum_triton.py`). The scheme, drawn: docs/design/handoff.md §6.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from k3serve.kernels._backend import gpu_kernels, has_module
from k3serve.kernels.mla.dcp import local_seq_lens
from k3serve.model.batch import ModelCache
from k3serve.transfer.checksum_lanes import _P1, _P2, _R, _SHIFT, Piece, _power_at, _powers
from k3serve.transfer.layout import CacheLayout, HeadSlice
from k3serve.transfer.metrics import BoundTransferMetrics

_R_MINUS_1_INV = pow(_R - 1, -1, _P2)
_WORD = 2  # bytes
_ROW = 1024  # words per matrix row: |row sums| < 2^42, exact in float64
_BATCH_WORDS = 1 << 22  # words per matmul: float64 temporaries of 32 MiB at most
_MAX_VIEW_WORDS = _P1 - 2


@dataclass(frozen=True)
class _Words:
    """Words of piece number `piece` as one int16 tensor, at word position `offset` of the view."""

    piece: int
    words: torch.Tensor
    offset: int


last_backend: dict[str, str] = {}  # "checksum" -> "triton" | "matmul": the GPU tests assert on it


def region_checksum(tensor_view: torch.Tensor, offset: int = 0) -> str:
    """Checksum of the bytes of `tensor_view` (row-major order), placed at byte `offset` of the view
    being checksummed. Same bytes at the same offset -> same value, on any device and tensor."""
    data = tensor_view.contiguous()
    return _checksum_pieces([_piece("", data, 0, data.numel() * data.element_size(), offset)])[""]


def combine_checksums(parts: Iterable[str]) -> str:
    """The checksum of a view assembled from disjoint parts, each checksummed at its own offset."""
    lane1 = lane2 = 0
    for part in parts:
        a, b = _parse(part)
        lane1, lane2 = (lane1 + a) % _P1, (lane2 + b) % _P2
    return _format(lane1, lane2)


@dataclass(frozen=True)
class CachedRequest:
    """One request's state in one rank's cache, what its checksums are cut from: token rows
    0..num_tokens-1 of its MLA blocks `block_ids` (in order), and its KDA slot `slot_id`."""

    cache: ModelCache
    layout: CacheLayout
    block_ids: Sequence[int]
    slot_id: int
    num_tokens: int

    def dcp_pages(self, dcp_size: int, dcp_rank: int, whole_blocks: bool) -> "CachedRequest":
        """The rows of this request that DCP rank `dcp_rank` of a decode engine holds, as a request of its own: the
        first n_r rows of its pages (`kernels/mla/dcp.py` `local_seq_lens`). `whole_blocks`: this cache holds
        page-sized blocks of every token (a prefill rank's), its pages are blocks dcp_rank, dcp_rank + W, ...;
        else it is that decode rank's own cache, whose blocks hold only its pages."""
        if dcp_size == 1:
            return self
        page = self.layout.block_size
        rows = int(local_seq_lens(torch.tensor([self.num_tokens]), page, dcp_size, dcp_rank)[0])
        blocks = self.block_ids[dcp_rank::dcp_size] if whole_blocks else self.block_ids
        return CachedRequest(self.cache, self.layout, tuple(blocks), self.slot_id, rows)


def request_checksums(request: CachedRequest, heads: HeadSlice | None, include_mla: bool = True) -> dict[str, str]:
    """Checksums, per region, of this cache's share of one decode rank's view of a request.

    Sender (prefill rank s, for decode rank r): `heads` and `include_mla` from `TPMapping.view(s, r)`.
    Receiver (decode rank r): `heads=HeadSlice.whole_shard(layout)`, `include_mla=True`; its
    values equal `combine_request_checksums` of the senders' dicts when the bytes arrived intact.
    All regions are summed in one pass (`_checksum_pieces`); bad ids or slots are refused (ValueError).
    """
    return _checksum_pieces(_request_pieces(request, heads, include_mla))


def views_checksums(
    request: CachedRequest, views: dict[int, tuple[HeadSlice | None, bool]], dcp_size: int = 1
) -> dict[int, dict[str, str]]:
    """`request_checksums` of several decode ranks' views at once (a sender feeding a wider decode engine):
    {decode rank: (heads, include_mla)} -> {decode rank: checksums}, equal to one call per rank, but in one
    pass (on CUDA one launch and one sync, not one per rank) over the distinct pieces: the MLA rows every
    view carries whole are summed once. A decode engine of `dcp_size` > 1 views only its pages of the MLA rows."""
    per_view = {r: _request_pieces(request.dcp_pages(dcp_size, r % dcp_size, whole_blocks=True), heads, mla)
                for r, (heads, mla) in views.items()}
    distinct = list({_piece_key(piece): piece for pieces in per_view.values() for piece in pieces}.values())
    lanes = dict(zip(map(_piece_key, distinct), _lanes(distinct)))
    return {r: _fold(pieces, [lanes[_piece_key(piece)] for piece in pieces]) for r, pieces in per_view.items()}


def _piece_key(piece: Piece) -> tuple:
    """Equal keys: the same words at the same view position, hence the same lanes."""
    return (piece.region, piece.source.data_ptr(), *piece[2:])


def _request_pieces(request: CachedRequest, heads: HeadSlice | None, include_mla: bool) -> list[Piece]:
    """The pieces of `request_checksums`."""
    cache, layout, block_ids, slot_id, num_tokens = (
        request.cache, request.layout, request.block_ids, request.slot_id, request.num_tokens)
    pieces: list[Piece] = []
    if include_mla and cache.mla_kv:
        if num_tokens > len(block_ids) * layout.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {layout.block_size}")
        blocks = tuple(int(b) for b in block_ids[: -(-num_tokens // layout.block_size)])
        for region, kv in zip(layout.mla, cache.mla_kv):  # token rows 0..num_tokens-1: whole blocks, the last cut
            block_bytes = kv[0].numel() * kv.element_size()
            pieces.append(_piece(region.name, kv, 0, num_tokens * region.bytes_per_token, 0, block_bytes, blocks))
    if heads is not None:
        first = layout.tp_rank * layout.num_kda_heads_local
        if not first <= heads.start < heads.stop <= first + layout.num_kda_heads_local:
            raise ValueError(f"heads [{heads.start}, {heads.stop}) are not on rank {layout.tp_rank} of {layout.tp_size}")
        lo, hi = heads.start - first, heads.stop - first  # local heads on this rank
        into_view = heads.start - heads.view_start  # first head's position in the decode view
        k = layout.kda_head_dim
        for region, state in zip(layout.kda_recurrent, cache.kda_recurrent):  # state[slot_id, lo:hi]
            at = slot_id * region.bytes_per_slot + lo * region.bytes_per_head
            pieces.append(_piece(region.name, state, at, (hi - lo) * region.bytes_per_head, into_view * region.bytes_per_head))
        for region, conv in zip(layout.kda_conv, cache.kda_conv):
            slot_at = slot_id * region.bytes_per_slot
            if hi - lo == heads.view_heads == layout.num_kda_heads_local:  # the whole slot, in place
                pieces.append(_piece(region.name, conv, slot_at, region.bytes_per_slot, 0))
                continue
            for sub in range(3):  # q, k, v sub-blocks, each cut by the same channel range
                at = slot_at + sub * region.bytes_per_subblock + lo * k * region.bytes_per_channel
                view_row = sub * heads.view_heads * k + into_view * k
                pieces.append(_piece(region.name, conv, at, (hi - lo) * k * region.bytes_per_channel,
                                     view_row * region.bytes_per_channel))  # fmt: skip
    return pieces


def block_checksums(cache: ModelCache, block_ids: Sequence[int]) -> list[str]:
    """The checksum of each block of `block_ids` taken as its own view (its rows in every MLA layer, layer after
    layer), all in one pass: equal bytes give equal values in any cache, on any device (an offload tier's entry
    against the device block it lands in)."""
    pieces = []
    for i, block_id in enumerate(block_ids):
        for layer, kv in enumerate(cache.mla_kv):
            nbytes = kv[0].numel() * kv.element_size()
            pieces.append(_piece(str(i), kv, int(block_id) * nbytes, nbytes, layer * nbytes))
    sums = _checksum_pieces(pieces) if pieces else {}
    return [sums.get(str(i), _format(0, 0)) for i in range(len(block_ids))]


def slot_checksum(cache: ModelCache, slot_id: int) -> str:
    """The checksum of one KDA slot's whole state (every KDA layer's recurrent state, then every conv window)."""
    pieces, offset = [], 0
    for pool in cache.kda_recurrent + cache.kda_conv:
        nbytes = pool[0].numel() * pool.element_size()
        pieces.append(_piece("slot", pool, int(slot_id) * nbytes, nbytes, offset))
        offset += nbytes
    return _checksum_pieces(pieces)["slot"] if pieces else _format(0, 0)


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


def _piece(
    region: str, source: torch.Tensor, at: int, nbytes: int, offset: int,
    run_bytes: int | None = None, runs: tuple[int, ...] = (0,),
) -> Piece:
    """`nbytes` bytes of `source` from byte `at` (or in runs of `run_bytes` from byte `at + r * run_bytes`,
    r in `runs`), placed at byte `offset` of a view; ValueError off the word grid or outside `source`."""
    if not source.is_contiguous():
        raise ValueError(f"checksummed tensors must be contiguous (region {region!r})")
    run_bytes = run_bytes or max(nbytes, _WORD)
    if (offset | nbytes | at | run_bytes | source.data_ptr()) % _WORD:
        raise ValueError(f"checksummed views are made of {_WORD}-byte words: offset {offset}, {nbytes} bytes")
    if offset < 0 or (offset + nbytes) // _WORD > _MAX_VIEW_WORDS:
        raise ValueError(f"checksummed views must lie in [0, {_MAX_VIEW_WORDS * _WORD}) bytes; got offset {offset} + {nbytes}")
    used = runs[: -(-nbytes // run_bytes)] or (0,)
    size = source.numel() * source.element_size()
    if at < 0 or min(used) < 0 or at + max(used) * run_bytes + min(run_bytes, nbytes) > size:
        raise ValueError(f"region {region!r}: bytes [{at}, +{nbytes}) in runs {runs} lie outside its {size}-byte tensor")
    return Piece(region, source, at // _WORD, nbytes // _WORD, offset // _WORD, run_bytes // _WORD, used)


def _checksum_pieces(pieces: list[Piece]) -> dict[str, str]:
    """Sum every piece's lanes into its region's (the scheme: docs/design/handoff.md §6)."""
    return _fold(pieces, _lanes(pieces))


def _lanes(pieces: list[Piece]) -> list[tuple[int, int]]:
    """Every piece's lanes: the Triton kernel of `checksum_triton` on CUDA (one launch, one host sync), the
    float64 matmul elsewhere."""
    if pieces and gpu_kernels(*(piece.source for piece in pieces)) and has_module("triton"):
        from k3serve.transfer.checksum_triton import piece_lanes

        last_backend["checksum"] = "triton"
        return piece_lanes(pieces)
    last_backend["checksum"] = "matmul"
    return _matmul_lanes(pieces)


def _fold(pieces: Sequence[Piece], lanes: Iterable[tuple[int, int]]) -> dict[str, str]:
    """Per-piece lanes added up per region."""
    sums: dict[str, tuple[int, int]] = {}
    for piece, (lane1, lane2) in zip(pieces, lanes, strict=True):
        a, b = sums.get(piece.region, (0, 0))
        sums[piece.region] = ((a + lane1) % _P1, (b + lane2) % _P2)
    return {region: _format(*lane) for region, lane in sums.items()}


def _matmul_lanes(pieces: list[Piece]) -> list[tuple[int, int]]:
    """Every piece's lanes through the float64 matmul (the fast path on CPU)."""
    lanes = [(0, 0)] * len(pieces)
    words = [_Words(i, _words(piece), piece.offset) for i, piece in enumerate(pieces)]
    for batch in _batches(words):
        for part, start_row, (s0, b1, v2) in zip(*_row_sums(batch)):
            n, off = part.words.numel(), part.offset
            shift = off - start_row * _ROW  # view position - matrix position of every word of the part
            lane1 = b1 + shift * s0 + _SHIFT * (n * off + n * (n + 1) // 2)
            geometric = (pow(_R, n, _P2) - 1) * _R_MINUS_1_INV
            lane2 = pow(_R, shift, _P2) * v2 + _SHIFT * pow(_R, off, _P2) * geometric
            a, b = lanes[part.piece]
            lanes[part.piece] = ((a + lane1) % _P1, (b + lane2) % _P2)
    return lanes


def _words(piece: Piece) -> torch.Tensor:
    """The piece's words as one int16 tensor: a view for one run, one index_select for several."""
    raw = piece.source.reshape(-1).view(torch.uint8)
    words = raw[: raw.numel() - raw.numel() % _WORD].view(torch.int16)
    if len(piece.runs) == 1:
        start = piece.first + piece.runs[0] * piece.run
        return words[start : start + piece.count]
    rows = words.as_strided((max(piece.runs) + 1, piece.run), (piece.run, 1), words.storage_offset() + piece.first)
    ids = torch.as_tensor(piece.runs, dtype=torch.long, device=words.device)
    return rows.index_select(0, ids).reshape(-1)[: piece.count]


def _batches(pieces: list[_Words]) -> Iterable[list[_Words]]:
    """Pieces cut to at most one batch each and packed into batches of <= _BATCH_WORDS words of
    whole rows (what one matmul takes)."""
    batch: list[_Words] = []
    rows = 0
    for piece in pieces:
        for start in range(0, max(piece.words.numel(), 1), _BATCH_WORDS):
            part = _Words(piece.piece, piece.words[start : start + _BATCH_WORDS], piece.offset + start)
            need = -(-part.words.numel() // _ROW)
            if batch and (rows + need) * _ROW > _BATCH_WORDS:
                yield batch
                batch, rows = [], 0
            batch.append(part)
            rows += need
    if batch:
        yield batch


def _row_sums(batch: list[_Words]) -> tuple[list[_Words], list[int], list[list[int]]]:
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
    powers = _powers(device)
    sums = (_position_weights(powers) @ matrix.t()).to(torch.int64)  # [4, rows], exact (weights first: 2x faster on CPU)
    row_start = torch.arange(0, rows * _ROW, _ROW, dtype=torch.int64, device=device)
    lane1 = (sums[1] + row_start * sums[0]).remainder_(_P1)
    lane2 = (sums[2].remainder(_P2) + sums[3].remainder(_P2) * 65536).remainder_(_P2)
    lane2 = (lane2 * _power_at(row_start, powers)).remainder_(_P2)
    per_row = torch.stack([sums[0], lane1, lane2], dim=1)
    cumulative = torch.cat([per_row.new_zeros(1, 3), per_row.cumsum(0)])  # < 2^43: exact
    bounds = torch.as_tensor(starts + [rows], device=device)
    per_piece = (cumulative[bounds[1:]] - cumulative[bounds[:-1]]).tolist()
    return batch, starts, per_piece




def _position_weights(powers: torch.Tensor) -> torch.Tensor:
    """[4, _ROW] float64 (exact): 1, j + 1, and R^j mod p2 split in 16-bit halves, for j < _ROW."""
    r_j = powers[0, :_ROW]
    j = torch.arange(1, _ROW + 1, dtype=torch.int64, device=powers.device)
    return torch.stack([torch.ones_like(j), j, r_j & 0xFFFF, r_j >> 16]).to(torch.float64)


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
