"""Which bytes go from which prefill rank to which decode rank, for any TP sizes P and D.

MLA latent KV is replicated on every rank; KDA state is sharded by head (docs/ARCHITECTURE.md, "Two
kinds of state"). With H KDA heads, prefill rank s holds heads [s*H/P, (s+1)*H/P) and decode rank
r holds [r*H/D, (r+1)*H/D). Example P = 4, D = 2, H = 8:

    KDA heads             0   1 | 2   3 | 4   5 | 6   7
    prefill ranks (P=4)   [ s0  ] [ s1  ] [ s2  ] [ s3  ]
    decode ranks  (D=2)   [     r0      ] [     r1      ]

    pair      MLA (whole blocks)   kda_recurrent.j (per slot)      kda_conv.j (per slot, 3 ops)
    s0 -> r0  yes (0 % 4 = 0)      heads 0-1 -> r0 local 0-1       q,k,v channels 0..2K each
    s1 -> r0  -                    heads 2-3 -> r0 local 2-3       q,k,v channels 2K..4K each
    s1 -> r1  yes (1 % 4 = 1)      -                               -
    s2 -> r1  -                    heads 4-5 -> r1 local 0-1
    s3 -> r1  -                    heads 6-7 -> r1 local 2-3

    P < D (P = 1, D = 2): s0 -> r0 heads 0-3, s0 -> r1 heads 4-7, and MLA s0 -> r0, s0 -> r1.

MLA: decode rank r receives exactly one copy, from prefill rank r % P, whole blocks; runs of
block ids consecutive on BOTH sides become one op:

    src block ids   3  4  5  9         runs  (3 -> 7, 3 blocks)  (9 -> 2, 1 block)
    dst block ids   7  8  9  2

KDA recurrent: a head range inside one slot `[H_local, K, V]` is one contiguous byte range.
KDA conv: a slot `[3*P_local, W-1]` is q|k|v sub-blocks, so the channel range [lo*K, hi*K) of the
heads is cut from each sub-block separately (three ops; merged into one when they happen to be
adjacent on both sides, as with P == D):

    prefill slot (P_local = 4K)   | q: h0 h1 h2 h3 | k: h0 h1 h2 h3 | v: h0 h1 h2 h3 |
    decode slot  (P_local = 2K)   | q: h2 h3 | k: h2 h3 | v: h2 h3 |      (r0 <- s0, heads 2-3 of 0-3)

Decode context parallelism (a decode engine of DCP size W, `CacheLayout.dcp_size`): decode block j holds W pages
of `block_size` tokens, rank r page r % W of each, at block j of its own tensor; a prefill engine (W = 1) holds
page-sized blocks. Prefill block i goes to the decode ranks of DCP rank i % W, into block i // W, still whole
blocks, so rank r receives only its pages (W = 2):

    src block ids   3  4  5  9  6          DCP rank 0 <- 3, 5, 6 into dst 7, 8, 2
    dst block ids   7     8     2          DCP rank 1 <- 4, 9    into dst 7, 8

`TPMapping` does the head arithmetic once per peer pair (at handshake); `ops(span)` then only
adds block/slot offsets, per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from k3serve.transfer.backend import RegionDesc, WriteOp
from k3serve.transfer.layout import CacheLayout, HeadSlice


@dataclass(frozen=True)
class RankCache:
    """One rank's cache as its peer sees it: layout plus registered regions (from the handshake)."""

    layout: CacheLayout
    regions: dict[str, RegionDesc]  # region name -> RegionDesc


@dataclass(frozen=True)
class RequestSpan:
    """The state of one request that moves: its blocks and its KDA slot on both sides."""

    src_block_ids: tuple[int, ...]  # [num_blocks] prefill blocks holding tokens 0..num_tokens-1
    dst_block_ids: tuple[int, ...]  # [num_blocks] decode blocks reserved for the same tokens
    src_slot: int  # prefill KDA slot holding the state after num_tokens tokens
    dst_slot: int  # decode KDA slot reserved for it
    num_tokens: int
    dcp_size: int = 1  # the decode engine's: a dst block holds that many src blocks, one on each DCP rank

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        if len(self.dst_block_ids) != -(-len(self.src_block_ids) // self.dcp_size):
            raise ValueError(f"{len(self.src_block_ids)} src blocks but {len(self.dst_block_ids)} dst blocks"
                             + (f" of {self.dcp_size} pages" if self.dcp_size > 1 else ""))


@dataclass(frozen=True)
class PairView:
    """What one (prefill rank, decode rank) pair carries: MLA or not, and which KDA heads."""

    mla: bool
    heads: HeadSlice | None  # None: no KDA heads in common


@dataclass(frozen=True)
class _SlotSegment:
    """One byte range per slot: src_base + slot*src_stride + src_offset -> same on dst, `length` bytes."""

    src_base: int
    src_stride: int
    src_offset: int
    dst_base: int
    dst_stride: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class _BlockSegment:
    """One MLA region: block b starts at base + b*block_bytes on each side."""

    src_base: int
    dst_base: int
    block_bytes: int
    num_src_blocks: int
    num_dst_blocks: int


class TPMapping:
    """Writes from prefill ranks (TP = P) into decode ranks (TP = D), precomputed per pair.

    `prefill` may hold all P ranks or only the ones this process drives; `decode` holds all D
    (a sender) or only this process's own rank (a decode rank checking a peer at handshake).
    """

    def __init__(self, prefill: Sequence[RankCache], decode: Sequence[RankCache]) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode rank")
        self.prefill = {c.layout.tp_rank: c for c in prefill}
        self.decode = {c.layout.tp_rank: c for c in decode}
        self.prefill_tp = _one_tp_size(prefill, "prefill")
        self.decode_tp = _one_tp_size(decode, "decode")
        if len(self.prefill) != len(prefill) or len(self.decode) != len(decode):
            raise ValueError("a rank appears twice")
        if not set(self.decode) <= set(range(self.decode_tp)):
            raise ValueError(f"decode ranks {sorted(self.decode)} outside TP size {self.decode_tp}")
        _check_compatible([c.layout for c in (*prefill, *decode)])
        for cache in (*prefill, *decode):
            cache.layout.check_regions(cache.regions)
        any_layout = prefill[0].layout
        self.block_size = any_layout.block_size
        if any(c.layout.dcp_size != 1 for c in prefill):
            raise ValueError("a prefill engine holds whole blocks: decode context parallelism is the decode pool's")
        self.dcp_size = decode[0].layout.dcp_size
        if any(c.layout.dcp_size != self.dcp_size for c in decode):
            raise ValueError(f"decode ranks disagree on dcp_size: {sorted({c.layout.dcp_size for c in decode})}")
        self.num_heads = any_layout.num_kda_heads
        self._views: dict[tuple[int, int], PairView] = {}
        self._mla: dict[tuple[int, int], list[_BlockSegment]] = {}
        self._slots: dict[tuple[int, int], list[_SlotSegment]] = {}
        for s in sorted(self.prefill):
            for r in sorted(self.decode):
                view = pair_view(s, r, self.prefill_tp, self.decode_tp, self.num_heads)
                if view is None:
                    continue
                self._views[(s, r)] = view
                self._mla[(s, r)] = self._mla_segments(s, r) if view.mla else []
                self._slots[(s, r)] = _merge(self._kda_segments(s, r, view.heads)) if view.heads else []

    # -- queries ----------------------------------------------------------------------------------
    @property
    def pairs(self) -> list[tuple[int, int]]:
        """(prefill rank, decode rank) pairs that carry anything, in rank order."""
        return list(self._views)

    def view(self, src_rank: int, dst_rank: int) -> PairView | None:
        return self._views.get((src_rank, dst_rank))

    def sources(self, dst_rank: int) -> list[int]:
        """Prefill ranks that write into decode rank `dst_rank` (the ones it waits for)."""
        return [s for (s, r) in self._views if r == dst_rank]

    def sending_ranks(self) -> set[int]:
        """Prefill ranks with at least one write: the ranks a pin lease waits for."""
        return {s for (s, _) in self._views}

    # -- per request ------------------------------------------------------------------------------
    def ops(self, span: RequestSpan) -> dict[tuple[int, int], list[WriteOp]]:
        """The WriteOps of one request, per (prefill rank, decode rank)."""
        num_blocks = -(-span.num_tokens // self.block_size)
        if len(span.src_block_ids) != num_blocks:
            raise ValueError(
                f"{span.num_tokens} tokens fill {num_blocks} blocks of {self.block_size}, span has {len(span.src_block_ids)}"
            )
        if span.dcp_size != self.dcp_size:
            raise ValueError(f"span of dcp_size {span.dcp_size} for a decode engine of dcp_size {self.dcp_size}")
        max_src, max_dst = max(span.src_block_ids), max(span.dst_block_ids)
        result = {}
        for pair, view in self._views.items():
            ops = []
            src_ids, dst_ids = self.pages(span.src_block_ids, span.dst_block_ids, pair[1])
            runs = _block_runs(src_ids, dst_ids)
            for seg in self._mla[pair]:
                if max_src >= seg.num_src_blocks or max_dst >= seg.num_dst_blocks:
                    raise ValueError(f"block ids out of range: src {span.src_block_ids}, dst {span.dst_block_ids}")
                for src_first, dst_first, count in runs:
                    ops.append(
                        WriteOp(
                            seg.src_base + src_first * seg.block_bytes,
                            seg.dst_base + dst_first * seg.block_bytes,
                            count * seg.block_bytes,
                        )
                    )
            for seg in self._slots[pair]:
                ops.append(
                    WriteOp(
                        seg.src_base + span.src_slot * seg.src_stride + seg.src_offset,
                        seg.dst_base + span.dst_slot * seg.dst_stride + seg.dst_offset,
                        seg.length,
                    )
                )
            self._check_slots(pair, span)
            result[pair] = ops
        return result

    def pages(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], dst_rank: int
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (src block, dst block) pairs of decode rank `dst_rank`'s pages, in order: every block without
        decode context parallelism; src blocks d, d + W, ... into dst blocks 0, 1, ... on DCP rank d."""
        src = tuple(src_block_ids[dst_rank % self.dcp_size :: self.dcp_size])
        return src, tuple(dst_block_ids[: len(src)])

    # -- construction -----------------------------------------------------------------------------
    def _mla_segments(self, s: int, r: int) -> list[_BlockSegment]:
        src, dst = self.prefill[s], self.decode[r]
        segments = []
        for a, b in zip(src.layout.mla, dst.layout.mla):
            segments.append(
                _BlockSegment(src.regions[a.name].addr, dst.regions[b.name].addr, a.bytes_per_block, a.num_blocks, b.num_blocks)
            )
        return segments

    def _kda_segments(self, s: int, r: int, heads: HeadSlice) -> list[_SlotSegment]:
        src, dst = self.prefill[s], self.decode[r]
        src_first, dst_first = s * src.layout.num_kda_heads_local, r * dst.layout.num_kda_heads_local
        segments = []
        for a, b in zip(src.layout.kda_recurrent, dst.layout.kda_recurrent):
            segments.append(
                _SlotSegment(
                    src.regions[a.name].addr, a.bytes_per_slot, (heads.start - src_first) * a.bytes_per_head,
                    dst.regions[b.name].addr, b.bytes_per_slot, (heads.start - dst_first) * b.bytes_per_head,
                    heads.num_heads * a.bytes_per_head,
                )
            )
        k = src.layout.kda_head_dim
        for a, b in zip(src.layout.kda_conv, dst.layout.kda_conv):
            for sub in range(3):  # q, k, v
                src_row = sub * a.channels_local + (heads.start - src_first) * k
                dst_row = sub * b.channels_local + (heads.start - dst_first) * k
                segments.append(
                    _SlotSegment(
                        src.regions[a.name].addr, a.bytes_per_slot, src_row * a.bytes_per_channel,
                        dst.regions[b.name].addr, b.bytes_per_slot, dst_row * b.bytes_per_channel,
                        heads.num_heads * k * a.bytes_per_channel,
                    )
                )
        return segments

    def _check_slots(self, pair: tuple[int, int], span: RequestSpan) -> None:
        s, r = pair
        num_src, num_dst = _num_slots(self.prefill[s].layout), _num_slots(self.decode[r].layout)
        if not (0 <= span.src_slot < num_src and 0 <= span.dst_slot < num_dst):
            raise ValueError(f"slot out of range: src {span.src_slot} of {num_src}, dst {span.dst_slot} of {num_dst}")


def pair_view(s: int, r: int, prefill_tp: int, decode_tp: int, num_heads: int) -> PairView | None:
    """What prefill rank `s` sends decode rank `r` (None: nothing), from the TP sizes alone."""
    per_src, per_dst = num_heads // prefill_tp, num_heads // decode_tp
    lo, hi = max(s * per_src, r * per_dst), min((s + 1) * per_src, (r + 1) * per_dst)
    view = PairView(mla=(r % prefill_tp == s), heads=HeadSlice(lo, hi, r * per_dst, per_dst) if lo < hi else None)
    return None if not view.mla and view.heads is None else view


def sending_ranks(prefill_tp: int, decode_tp: int, num_heads: int) -> set[int]:
    """Prefill ranks that write into some rank of a decode engine: the ranks whose TransferReady
    its rank 0 waits for (what `TPMapping.sending_ranks()` gives with every rank known)."""
    for tp in (prefill_tp, decode_tp):
        if tp < 1 or num_heads % tp:
            raise ValueError(f"TP size {tp} does not divide the {num_heads} KDA heads")
    return {s for s in range(prefill_tp) for r in range(decode_tp) if pair_view(s, r, prefill_tp, decode_tp, num_heads)}


def _block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src first, dst first, count) of maximal runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_ids, dst_ids):
        if src < 0 or dst < 0:
            raise ValueError(f"negative block id in src {list(src_ids)} / dst {list(dst_ids)}")
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def _merge(segments: list[_SlotSegment]) -> list[_SlotSegment]:
    """Join segments that continue each other on both sides (same regions, adjacent offsets)."""
    merged: list[_SlotSegment] = []
    for seg in segments:
        last = merged[-1] if merged else None
        if (
            last is not None
            and (last.src_base, last.src_stride, last.dst_base, last.dst_stride)
            == (seg.src_base, seg.src_stride, seg.dst_base, seg.dst_stride)
            and last.src_offset + last.length == seg.src_offset
            and last.dst_offset + last.length == seg.dst_offset
        ):
            merged[-1] = _SlotSegment(
                last.src_base, last.src_stride, last.src_offset,
                last.dst_base, last.dst_stride, last.dst_offset, last.length + seg.length,
            )
        else:
            merged.append(seg)
    return merged


def _num_slots(layout: CacheLayout) -> int:
    return layout.kda_recurrent[0].num_slots if layout.kda_recurrent else 0


def _one_tp_size(caches: Sequence[RankCache], side: str) -> int:
    sizes = {c.layout.tp_size for c in caches}
    if len(sizes) != 1:
        raise ValueError(f"{side} ranks disagree on TP size: {sorted(sizes)}")
    return sizes.pop()


def _check_compatible(layouts: list[CacheLayout]) -> None:
    """Same compat hash (model, dtype, block size, version) and same layer structure everywhere."""
    hashes = {lay.compat_hash for lay in layouts}
    if len(hashes) != 1:
        raise ValueError(f"prefill and decode caches are incompatible (compat hashes {sorted(hashes)})")
    first = layouts[0]
    for lay in layouts[1:]:
        same = (
            lay.block_size == first.block_size
            and lay.layout_version == first.layout_version
            and (lay.kv_dtype, lay.recurrent_dtype, lay.conv_dtype) == (first.kv_dtype, first.recurrent_dtype, first.conv_dtype)
            and (lay.num_kda_heads, lay.kda_head_dim) == (first.num_kda_heads, first.kda_head_dim)
            and len(lay.mla) == len(first.mla)
            and len(lay.kda_recurrent) == len(first.kda_recurrent)
            and [m.kv_dim for m in lay.mla] == [m.kv_dim for m in first.mla]
            and [c.width for c in lay.kda_conv] == [c.width for c in first.kda_conv]
        )
        if not same:
            raise ValueError(f"cache layouts differ beyond TP rank/size:\n{first}\n{lay}")
