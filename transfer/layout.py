"""Byte layout of one rank's cache, as a peer needs it to address writes: `CacheLayout`.

One region per cache tensor, named by its position in `ModelCache` (`mla.{i}` per MLA layer: blocks;
`kda_recurrent.{j}` and `kda_conv.{j}` per KDA layer: slots, a conv slot three q|k|v sub-blocks). A layout is a
frozen dataclass that round-trips through JSON (the handshake carries it) and carries `compat_hash`: two engines
may exchange state only if their hashes are equal. The region table: docs/design/handoff.md §5.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from k3serve.model.batch import ModelCache
from k3serve.model.config import ModelConfig
from k3serve.transfer.backend import RegionDesc, TransferBackend

if TYPE_CHECKING:
    from k3serve.engine.kv_handoff import CacheView

LAYOUT_VERSION = 1  # bump whenever the byte layout of any region changes

# ModelConfig fields that do not change what the cache holds: naming, limits, token ids. Every
# other parsed field shapes the math that produces the state and goes into the hash. The raw
# `hf_config` is left out on purpose: it carries keys such as `transformers_version` whose change
# must not force prefill and decode pools to upgrade in lockstep (PD_PRIOR_ART §7.6).
_HASH_EXCLUDED_FIELDS = frozenset({"hf_config", "weight_prefix", "max_position_embeddings", "bos_token_id", "eos_token_id"})


def dtype_name(dtype: torch.dtype | str) -> str:
    """'bfloat16' for torch.bfloat16 (and for the string 'bfloat16' or 'torch.bfloat16')."""
    return str(dtype).removeprefix("torch.")


def compatibility_hash(
    config: ModelConfig, cache_dtype: torch.dtype | str, block_size: int, layout_version: int = LAYOUT_VERSION
) -> str:
    """sha256 (hex) of a canonical JSON of everything that must agree for a decode engine to
    continue from a prefill engine's cache bytes. TP size is deliberately not in it: the TP
    mapping bridges different TP sizes."""
    fields = {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in _HASH_EXCLUDED_FIELDS
    }
    canonical = {
        "model": _jsonable(fields),
        "cache_dtype": dtype_name(cache_dtype),
        "block_size": block_size,
        "layout_version": layout_version,
    }
    blob = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class MLARegion:
    """One MLA layer's paged latent KV: `[num_blocks, block_size, kv_dim]`."""

    name: str  # "mla.{i}"
    num_blocks: int
    block_size: int
    kv_dim: int  # kv_lora_rank + qk_rope_head_dim
    itemsize: int

    @property
    def bytes_per_token(self) -> int:
        return self.kv_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


@dataclass(frozen=True)
class KDARecurrentRegion:
    """One KDA layer's recurrent state pool: `[num_slots, num_heads_local, head_k, head_v]` fp32."""

    name: str  # "kda_recurrent.{j}"
    num_slots: int
    num_heads_local: int
    head_k: int
    head_v: int
    itemsize: int

    @property
    def bytes_per_head(self) -> int:
        return self.head_k * self.head_v * self.itemsize

    @property
    def bytes_per_slot(self) -> int:
        return self.num_heads_local * self.bytes_per_head

    @property
    def num_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot


@dataclass(frozen=True)
class KDAConvRegion:
    """One KDA layer's conv window pool: `[num_slots, 3 * channels_local, width]`, q|k|v sub-blocks."""

    name: str  # "kda_conv.{j}"
    num_slots: int
    channels_local: int  # P_local = H_local * K channels per sub-block
    width: int  # conv kernel - 1
    itemsize: int

    @property
    def bytes_per_channel(self) -> int:
        return self.width * self.itemsize

    @property
    def bytes_per_subblock(self) -> int:
        return self.channels_local * self.bytes_per_channel

    @property
    def bytes_per_slot(self) -> int:
        return 3 * self.bytes_per_subblock

    @property
    def num_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot


@dataclass(frozen=True)
class HeadSlice:
    """Global KDA heads [start, stop) as seen by one decode rank whose shard is heads
    [view_start, view_start + view_heads). The unit in which KDA state moves and is checksummed:

        global heads      0   1   2   3   4   5   6   7
        decode rank 1                     [===view====]     view_start=4, view_heads=4
        from prefill 2                    [=====]           start=4, stop=6
    """

    start: int
    stop: int
    view_start: int
    view_heads: int

    def __post_init__(self) -> None:
        if not self.view_start <= self.start < self.stop <= self.view_start + self.view_heads:
            raise ValueError(f"head slice [{self.start}, {self.stop}) outside its view {self}")

    @property
    def num_heads(self) -> int:
        return self.stop - self.start

    @classmethod
    def whole_shard(cls, layout: "CacheLayout") -> "HeadSlice":
        """Every head `layout`'s rank holds: the decode rank's own view of itself."""
        start = layout.tp_rank * layout.num_kda_heads_local
        return cls(start, start + layout.num_kda_heads_local, start, layout.num_kda_heads_local)


@dataclass(frozen=True)
class CacheLayout:
    """Everything a peer needs to compute byte offsets into this rank's cache regions."""

    tp_size: int
    tp_rank: int
    block_size: int
    kv_dtype: str  # MLA latent KV
    recurrent_dtype: str  # always float32 today
    conv_dtype: str
    num_kda_heads: int  # H, over all ranks
    kda_head_dim: int  # K (= V)
    mla: tuple[MLARegion, ...]
    kda_recurrent: tuple[KDARecurrentRegion, ...]
    kda_conv: tuple[KDAConvRegion, ...]
    compat_hash: str
    layout_version: int = LAYOUT_VERSION
    dcp_size: int = 1  # decode context parallelism: rank r holds page r % dcp_size of every block (block_size tokens)

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} outside tp_size={self.tp_size}")
        if self.dcp_size < 1 or self.tp_size % self.dcp_size:
            raise ValueError(f"dcp_size={self.dcp_size} does not divide tp_size={self.tp_size}")
        if self.num_kda_heads % self.tp_size:
            raise ValueError(f"tp_size={self.tp_size} does not divide num_kda_heads={self.num_kda_heads}")
        if len(self.kda_recurrent) != len(self.kda_conv):
            raise ValueError("every KDA layer needs one recurrent and one conv region")

    @property
    def dcp_rank(self) -> int:
        """The page of every block this rank holds (0 without decode context parallelism)."""
        return self.tp_rank % self.dcp_size

    @property
    def num_kda_heads_local(self) -> int:
        return self.num_kda_heads // self.tp_size

    @property
    def region_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in (*self.mla, *self.kda_recurrent, *self.kda_conv))

    @classmethod
    def from_cache(cls, cache: ModelCache, config: ModelConfig, tp_rank: int, tp_size: int) -> "CacheLayout":
        """Describe `cache` (this rank's ModelCache), checking its shapes against the config."""
        kda = config.kda
        if kda.num_heads % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide KDA num_heads={kda.num_heads}")
        h_local, d, width = kda.num_heads // tp_size, kda.head_dim, kda.conv_kernel_size - 1
        if len(cache.mla_kv) != len(config.mla_layers) or len(cache.kda_recurrent) != len(config.kda_layers):
            raise ValueError(
                f"cache has {len(cache.mla_kv)} MLA / {len(cache.kda_recurrent)} KDA layers, config has "
                f"{len(config.mla_layers)} / {len(config.kda_layers)}"
            )
        mla = []
        for i, t in enumerate(cache.mla_kv):
            _expect_shape(f"mla.{i}", t, (t.shape[0], cache.block_size, config.mla_kv_dim))
            mla.append(MLARegion(f"mla.{i}", t.shape[0], cache.block_size, config.mla_kv_dim, t.element_size()))
        recurrent, conv = [], []
        for j, (r, c) in enumerate(zip(cache.kda_recurrent, cache.kda_conv)):
            _expect_shape(f"kda_recurrent.{j}", r, (r.shape[0], h_local, d, d))
            _expect_shape(f"kda_conv.{j}", c, (r.shape[0], 3 * h_local * d, width))
            recurrent.append(KDARecurrentRegion(f"kda_recurrent.{j}", r.shape[0], h_local, d, d, r.element_size()))
            conv.append(KDAConvRegion(f"kda_conv.{j}", c.shape[0], h_local * d, width, c.element_size()))
        kv_dtype = cache.mla_kv[0].dtype if cache.mla_kv else torch.float32
        conv_dtype = cache.kda_conv[0].dtype if cache.kda_conv else kv_dtype
        rec_dtype = cache.kda_recurrent[0].dtype if cache.kda_recurrent else torch.float32
        return cls(
            tp_size=tp_size,
            tp_rank=tp_rank,
            block_size=cache.block_size,
            kv_dtype=dtype_name(kv_dtype),
            recurrent_dtype=dtype_name(rec_dtype),
            conv_dtype=dtype_name(conv_dtype),
            num_kda_heads=kda.num_heads,
            kda_head_dim=d,
            mla=tuple(mla),
            kda_recurrent=tuple(recurrent),
            kda_conv=tuple(conv),
            compat_hash=compatibility_hash(config, kv_dtype, cache.block_size),
            dcp_size=cache.dcp_size,
        )

    @classmethod
    def from_view(cls, view: CacheView) -> "CacheLayout":
        """The layout of a rank's cache as the handoff seam shows it, hashed with its engine's dtype and
        block size (what every peer of that engine must match)."""
        layout = cls.from_cache(view.cache, view.model_config, view.tp_rank, view.tp_size)
        compat = compatibility_hash(view.model_config, view.cache_dtype, view.block_size)
        return dataclasses.replace(layout, compat_hash=compat)

    # -- serialization ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Without DCP the dict has no `dcp_size`: a peer that predates it reads the layout as before."""
        data = dataclasses.asdict(self)
        if self.dcp_size == 1:
            del data["dcp_size"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CacheLayout":
        data = dict(data)
        data["mla"] = tuple(MLARegion(**r) for r in data["mla"])
        data["kda_recurrent"] = tuple(KDARecurrentRegion(**r) for r in data["kda_recurrent"])
        data["kda_conv"] = tuple(KDAConvRegion(**r) for r in data["kda_conv"])
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CacheLayout":
        return cls.from_dict(json.loads(text))

    # -- fail-closed checks -----------------------------------------------------------------------
    def check_regions(self, regions: dict[str, RegionDesc]) -> None:
        """Raise ValueError unless every region of this layout is registered with exactly its size.

        A state pool that was never registered made decode run from zeroed state (PD_PRIOR_ART §7.1);
        this is the check that refuses such a peer before any write is posted."""
        sizes = {r.name: r.num_bytes for r in (*self.mla, *self.kda_recurrent, *self.kda_conv)}
        missing = sorted(set(sizes) - set(regions))
        if missing:
            raise ValueError(f"cache regions not registered: {missing}")
        wrong = {n: (regions[n].length, size) for n, size in sizes.items() if regions[n].length != size}
        if wrong:
            raise ValueError(f"registered region sizes differ from the layout, (registered, expected): {wrong}")


def register_cache(backend: TransferBackend, cache: ModelCache) -> dict[str, RegionDesc]:
    """Register every cache tensor with `backend` under its region name; returns name -> RegionDesc."""
    tensors = {f"mla.{i}": t for i, t in enumerate(cache.mla_kv)}
    tensors.update({f"kda_recurrent.{j}": t for j, t in enumerate(cache.kda_recurrent)})
    tensors.update({f"kda_conv.{j}": t for j, t in enumerate(cache.kda_conv)})
    regions = {}
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"cache tensor {name} is not contiguous: byte offsets would be wrong")
        regions[name] = backend.register(name, tensor)
    return regions


def _expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: cache tensor has shape {tuple(tensor.shape)}, the config implies {shape}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: cache tensor is not contiguous")


def _jsonable(value: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists, so json.dumps sees one canonical form."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
