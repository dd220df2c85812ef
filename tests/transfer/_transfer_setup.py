"""What the transfer tests share: a tiny config that splits over 8 ranks, TP sharding of a TP-1
cache (the specification of what each rank holds), and a prefill/decode pair wired through
LocalBackend agents.

    reference (TP 1)  --shard(s, P)-->  prefill rank s caches   --TPMapping ops-->  decode rank r
                      --shard(r, D)-->  what decode rank r must hold afterwards (in the reserved
                                        blocks and slot; every other byte unchanged)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3serve.model.batch import ModelCache
from k3serve.model.config import ModelConfig
from k3serve.transfer.backend import TransferStatus
from k3serve.transfer.layout import CacheLayout, register_cache
from k3serve.transfer.local import LocalBackend
from k3serve.transfer.tp_map import RankCache, RequestSpan, TPMapping
from tiny_presets import kimi_linear_tiny

BLOCK_SIZE = 4


def tiny_config(**kda: object) -> ModelConfig:
    """Kimi-Linear tiny with 8 KDA heads of dim 4 (so TP 1, 2, 4, 8 all divide it)."""
    hf = kimi_linear_tiny()
    hf.update(num_attention_heads=8, num_key_value_heads=8)
    hf["linear_attn_config"].update({"num_heads": 8, "head_dim": 4, **kda})
    return ModelConfig.from_hf_dict(hf)


def fill_random_bytes(cache: ModelCache, seed: int) -> None:
    """Every byte random: distinct per (rank, layer, head, channel) with overwhelming probability,
    and any dtype (NaN bit patterns included) compares exactly as bytes."""
    gen = torch.Generator().manual_seed(seed)
    for t in (*cache.mla_kv, *cache.kda_recurrent, *cache.kda_conv):
        raw = t.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def shard(full: ModelCache, rank: int, tp: int) -> ModelCache:
    """The cache a TP-`tp` engine's rank `rank` holds for the same state as the TP-1 cache `full`:
    MLA replicated, recurrent heads [rank*H/tp, (rank+1)*H/tp), and the same channel range cut
    from each of the q, k, v sub-blocks of the conv window."""
    recurrent, conv = [], []
    for r, c in zip(full.kda_recurrent, full.kda_conv):
        h = r.shape[1] // tp
        recurrent.append(r[:, rank * h : (rank + 1) * h].clone())
        p = c.shape[1] // 3
        per = p // tp
        conv.append(torch.cat([c[:, sub * p + rank * per : sub * p + (rank + 1) * per] for sub in range(3)], dim=1))
    return ModelCache([t.clone() for t in full.mla_kv], recurrent, conv, full.block_size)


@dataclass
class Side:
    caches: list[ModelCache]  # [tp] per rank
    layouts: list[CacheLayout]
    backends: list[LocalBackend]

    def rank_caches(self) -> list[RankCache]:
        return [RankCache(lay, {r.name: r for r in b.agent_info().regions}) for lay, b in zip(self.layouts, self.backends)]


def make_side(config: ModelConfig, caches: list[ModelCache], new_backend: Callable[[], LocalBackend] = LocalBackend) -> Side:
    """One engine: a layout and a LocalBackend agent (with every cache tensor registered) per rank."""
    tp = len(caches)
    layouts = [CacheLayout.from_cache(c, config, rank, tp) for rank, c in enumerate(caches)]
    backends = []
    for cache in caches:
        backend = new_backend()
        register_cache(backend, cache)
        backends.append(backend)
    return Side(caches, layouts, backends)


def connect(prefill: Side, decode: Side) -> TPMapping:
    for src in prefill.backends:
        for dst in decode.backends:
            src.connect(dst.agent_info())
    return TPMapping(prefill.rank_caches(), decode.rank_caches())


def run_transfer(mapping: TPMapping, prefill: Side, decode: Side, span: RequestSpan, max_polls: int = 100) -> None:
    """Post every pair's writes and poll them to DONE."""
    handles = []
    for (s, r), ops in mapping.ops(span).items():
        backend = prefill.backends[s]
        handles.append((backend, backend.write(decode.backends[r].endpoint, ops)))
    for backend, handle in handles:
        for _ in range(max_polls):
            status = backend.poll(handle)
            if status is not TransferStatus.PENDING:
                break
        assert status is TransferStatus.DONE, backend.error(handle)
        backend.release(handle)


def close(*sides: Side) -> None:
    for side in sides:
        for backend in side.backends:
            backend.close()


def byte_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
