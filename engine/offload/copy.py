"""Copies of prefix-unit pieces between two caches shaped alike (the device's and a tier's host copy), and their
sizes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3serve.model.batch import ModelCache


def cache_like(device: ModelCache, num_blocks: int, num_slots: int, pin_memory: bool) -> ModelCache:
    """A host cache of `num_blocks` MLA blocks and `num_slots` KDA slots laid out as `device`'s (pinned if asked)."""
    def pools(like: list[torch.Tensor], n: int) -> list[torch.Tensor]:
        return [torch.zeros((n, *t.shape[1:]), dtype=t.dtype, pin_memory=pin_memory) for t in like]

    return ModelCache(mla_kv=pools(device.mla_kv, num_blocks), kda_recurrent=pools(device.kda_recurrent, num_slots),
                      kda_conv=pools(device.kda_conv, num_slots), block_size=device.block_size)


def block_bytes(cache: ModelCache) -> int:
    """Bytes of one block in every MLA layer."""
    return sum(kv[0].numel() * kv.element_size() for kv in cache.mla_kv)


def slot_bytes(cache: ModelCache) -> int:
    """Bytes of one slot's KDA state in every KDA layer (recurrent + conv)."""
    return sum(p[0].numel() * p.element_size() for p in cache.kda_recurrent + cache.kda_conv)


def copy_blocks(src: ModelCache, dst: ModelCache, pairs: Sequence[tuple[int, int]]) -> None:
    """Block `s` of `src` into block `d` of `dst` for each (s, d), every MLA layer (one gather a layer)."""
    if not pairs:
        return
    for a, b in zip(src.mla_kv, dst.mla_kv):
        s = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=a.device)
        d = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=b.device)
        b.index_copy_(0, d, a.index_select(0, s).to(b.device))


def copy_slot(src: ModelCache, dst: ModelCache, src_slot: int, dst_slot: int) -> None:
    """Slot `src_slot` of `src` into slot `dst_slot` of `dst`, every KDA layer (recurrent + conv)."""
    for a, b in zip(src.kda_recurrent + src.kda_conv, dst.kda_recurrent + dst.kda_conv):
        b[dst_slot].copy_(a[src_slot])
