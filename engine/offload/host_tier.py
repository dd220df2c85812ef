"""The host tier: prefix units in one engine's host memory (pinned where CUDA), LRU under a byte budget.

Its two halves mirror the device's. `HostIndex` (the scheduler's, rank 0) is a `PrefixCache` over a host
`BlockPool` and `StatePool`: host block and slot ids, chained hashes, ref counts, LRU eviction, so a unit is found,
held while it is copied and evicted exactly as a device one is, and the blocks units share are stored once.
`HostData` (every rank's runner) holds the bytes, a `ModelCache` laid out as the device's, and a checksum per
block and slot, taken when the entry is written and checked against what lands on the device at a load.

    store  (write-through: the step after a prompt's checkpoint is taken)
        begin_store   host blocks for the unit's blocks the host lacks (LRU-evicting), one host slot
        runner        device -> host copies, checksums of the host entries
        end_store     blocks and checkpoint registered under their hashes, then released (LRU)
    load   (a waiting request whose longest unit is here, longer than the device's)
        begin_load    the host entries held (not evictable while they are read)
        runner        host -> device copies into fresh device blocks and a slot, checksums of what landed
        end_load      released; a mismatch forgets the unit's checkpoint (never a hit again)
"""

from __future__ import annotations

from collections.abc import Sequence

from k3serve.engine.block_pool import BlockPool
from k3serve.engine.offload.copy import block_bytes, cache_like, copy_blocks, copy_slot, slot_bytes
from k3serve.engine.offload.unit import UnitCopy
from k3serve.engine.prefix_cache import PrefixCache
from k3serve.engine.state_pool import StatePool
from k3serve.model.batch import ModelCache
from k3serve.transfer.checksum import block_checksums, slot_checksum

TIER = "host"


def host_pool_sizes(host_bytes: int, bytes_per_block: int, bytes_per_slot: int, num_blocks: int,
                    num_slots: int) -> tuple[int, int]:
    """(blocks, slots) of a host tier of `host_bytes`, split as the device pools are (`num_blocks`, `num_slots`);
    ValueError if it holds less than one block and one slot."""
    device_bytes = num_blocks * bytes_per_block + num_slots * bytes_per_slot
    scale = host_bytes / device_bytes
    slots = max(1, int(num_slots * scale))
    blocks = (host_bytes - slots * bytes_per_slot) // bytes_per_block
    if blocks < 1:
        raise ValueError(f"kv_offload_host_bytes={host_bytes} holds no MLA block of {bytes_per_block} bytes "
                         f"beside one KDA slot of {bytes_per_slot} bytes")
    return int(blocks), slots


class HostIndex:
    """The scheduler's half: which units the host holds, and their host ids."""

    name = TIER
    restores_kda_state = True

    def __init__(self, num_blocks: int, num_slots: int, block_size: int) -> None:
        self.blocks, self.slots = BlockPool(num_blocks, block_size), StatePool(num_slots)
        self.cache = PrefixCache(self.blocks, self.slots)
        self.block_size = block_size

    def lookup(self, block_hashes: Sequence[int]) -> int:
        best = 0
        for i, block_hash in enumerate(block_hashes):
            if self.blocks.get_cached_block(block_hash) is None:
                break
            if self.slots.lookup(block_hash) is not None:
                best = i + 1
        return best

    def begin_store(self, request_id: str, block_hashes: Sequence[int], device_block_ids: Sequence[int],
                    device_slot: int) -> UnitCopy | None:
        held = [self.blocks.get_cached_block(h) for h in block_hashes]
        if self.slots.lookup(block_hashes[-1]) is not None and None not in held:
            return None  # stored whole already
        present = [b for b in held if b is not None]
        self.blocks.share(present)  # not evictable by the allocation below
        missing = [i for i, b in enumerate(held) if b is None]
        if not (self.blocks.can_allocate(len(missing)) and self.slots.can_allocate(1)):
            self.blocks.free(present)
            return None  # every host entry is being read: best effort, no store
        for i, block_id in zip(missing, self.blocks.allocate(len(missing))):
            held[i] = block_id
        self.slots.forget(block_hashes[-1])  # a checkpoint whose blocks were evicted: replaced whole
        slot = self.slots.allocate()
        moves = tuple((device_block_ids[i], held[i]) for i in missing)
        return UnitCopy(TIER, request_id, tuple(block_hashes), len(block_hashes) * self.block_size, moves,
                        device_slot, slot, tier_blocks=tuple(held))

    def end_store(self, op: UnitCopy, ok: bool) -> None:
        if ok:
            self.cache.insert(op.block_hashes, op.tier_blocks, op.num_tokens, op.tier_slot)
        self.blocks.free(op.tier_blocks)
        self.slots.free(op.tier_slot)

    def begin_load(self, request_id: str, block_hashes: Sequence[int], fresh: Sequence[tuple[int, int]],
                   device_slot: int) -> UnitCopy | None:
        if self.lookup(block_hashes) != len(block_hashes):
            return None
        held = tuple(self.blocks.get_cached_block(h) for h in block_hashes)
        slot = self.slots.lookup(block_hashes[-1])
        self.blocks.share(held)
        self.slots.share(slot)
        moves = tuple((device_id, held[i]) for device_id, i in fresh)
        return UnitCopy(TIER, request_id, tuple(block_hashes), len(block_hashes) * self.block_size, moves,
                        device_slot, slot, tier_blocks=held)

    def end_load(self, op: UnitCopy, ok: bool) -> None:
        self.blocks.free(op.tier_blocks)
        self.slots.free(op.tier_slot)
        if not ok:
            self.slots.forget(op.key)

    def clear(self) -> None:
        """Evict every unused entry."""
        self.cache.clear()


class HostData:
    """One rank's half: the host copy of its cache and each entry's checksum (engine thread)."""

    name = TIER

    def __init__(self, device: ModelCache, num_blocks: int, num_slots: int, pin_memory: bool) -> None:
        self.cache = cache_like(device, num_blocks, num_slots, pin_memory)
        self.block_sums: dict[int, str] = {}  # host block id -> checksum of its bytes
        self.slot_sums: dict[int, str] = {}  # host slot id -> checksum of its state
        self.bytes_per_block, self.bytes_per_slot = block_bytes(device), slot_bytes(device)

    def store(self, op: UnitCopy, device: ModelCache) -> int:
        copy_blocks(device, self.cache, op.moves)
        copy_slot(device, self.cache, op.device_slot, op.tier_slot)
        host_blocks = [h for _, h in op.moves]
        self.block_sums.update(zip(host_blocks, block_checksums(self.cache, host_blocks)))
        self.slot_sums[op.tier_slot] = slot_checksum(self.cache, op.tier_slot)
        return len(op.moves) * self.bytes_per_block + self.bytes_per_slot

    def close(self) -> None:
        """Nothing outside this process's memory."""

    def load(self, op: UnitCopy, device: ModelCache) -> int | None:
        copy_blocks(self.cache, device, [(h, d) for d, h in op.moves])
        copy_slot(self.cache, device, op.tier_slot, op.device_slot)
        landed = block_checksums(device, [d for d, _ in op.moves])
        if landed != [self.block_sums.get(h) for _, h in op.moves]:
            return None
        if slot_checksum(device, op.device_slot) != self.slot_sums.get(op.tier_slot):
            return None
        return len(op.moves) * self.bytes_per_block + self.bytes_per_slot
