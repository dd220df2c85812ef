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

Each byte b at view position i adds two lanes: (b+1)*(i+1) mod p1, with p1 = 2^31-1 prime, so a
single changed byte or two swapped unequal bytes ALWAYS change lane 1 (views under 2 GiB); and
(b+1)*mix(i) mod p2 with a scrambled position weight for everything else. All integer math in
torch on the tensor's own device (exact, so CPU and GPU agree); only two scalars reach the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from k3serve.model.batch import ModelCache
from k3serve.transfer.layout import CacheLayout, HeadSlice
from k3serve.transfer.metrics import BoundTransferMetrics

_P1 = 2**31 - 1  # prime: position weights 1..p1-1 are distinct and nonzero
_P2 = 2**31 - 19  # prime
_MIX = 0x5DEECE6D  # < p2: scrambles the lane-2 position weight
_CHUNK = 1 << 22  # bytes per step: bounds the int64 temporaries to a few x 32 MiB
_MAX_VIEW_BYTES = _P1 - 2


def region_checksum(tensor_view: torch.Tensor, offset: int = 0) -> str:
    """Checksum of the bytes of `tensor_view` (row-major order), placed at byte `offset` of the view
    being checksummed. Same bytes at the same offset -> same value, on any device and tensor."""
    lane1, lane2 = _lanes(tensor_view, offset)
    return _format(lane1, lane2)


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
    """
    sums: dict[str, str] = {}
    if include_mla:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.mla_kv[0].device if cache.mla_kv else "cpu")
        if num_tokens > len(block_ids) * layout.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {layout.block_size}")
        for region, kv in zip(layout.mla, cache.mla_kv):
            rows = kv.index_select(0, ids).reshape(-1, region.kv_dim)[:num_tokens]
            sums[region.name] = region_checksum(rows)
    if heads is not None:
        first = layout.tp_rank * layout.num_kda_heads_local
        if not first <= heads.start < heads.stop <= first + layout.num_kda_heads_local:
            raise ValueError(f"heads [{heads.start}, {heads.stop}) are not on rank {layout.tp_rank} of {layout.tp_size}")
        lo, hi = heads.start - first, heads.stop - first  # local heads on this rank
        into_view = heads.start - heads.view_start  # first head's position in the decode view
        k = layout.kda_head_dim
        for region, state in zip(layout.kda_recurrent, cache.kda_recurrent):
            sums[region.name] = region_checksum(state[slot_id, lo:hi], into_view * region.bytes_per_head)
        for region, conv in zip(layout.kda_conv, cache.kda_conv):
            parts = []
            for sub in range(3):  # q, k, v sub-blocks, each cut by the same channel range
                rows = conv[slot_id, sub * region.channels_local + lo * k : sub * region.channels_local + hi * k]
                view_row = sub * heads.view_heads * k + into_view * k
                parts.append(region_checksum(rows, view_row * region.bytes_per_channel))
            sums[region.name] = combine_checksums(parts)
    return sums


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


def _lanes(tensor: torch.Tensor, offset: int) -> tuple[int, int]:
    data = tensor.contiguous().reshape(-1).view(torch.uint8)
    if offset < 0 or offset + data.numel() > _MAX_VIEW_BYTES:
        raise ValueError(f"checksummed views must lie in [0, {_MAX_VIEW_BYTES}) bytes; got offset {offset} + {data.numel()}")
    lane1 = torch.zeros((), dtype=torch.int64, device=data.device)
    lane2 = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, data.numel(), _CHUNK):
        chunk = data[start : start + _CHUNK].to(torch.int64) + 1  # 1..256: a zero byte still counts
        pos = torch.arange(chunk.numel(), dtype=torch.int64, device=data.device) + (offset + start)
        # products stay < 2^40 and chunk sums < 2^62: no int64 overflow anywhere
        lane1 = (lane1 + (chunk * (pos + 1)).remainder_(_P1).sum()) % _P1
        mix = (pos * _MIX).remainder_(_P2)
        mix = (mix * mix).remainder_(_P2) + 1
        lane2 = (lane2 + (chunk * mix).remainder_(_P2).sum()) % _P2
    return int(lane1.item()), int(lane2.item())


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
