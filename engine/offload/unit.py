"""The prefix unit and the copies that move one between the device pools and a tier (plain values: they ride in
`SchedulerOutput` to every TP rank).

A unit is reusable only whole: the MLA blocks of its first `num_tokens` tokens AND the KDA checkpoint (recurrent +
conv, every KDA layer) after exactly those tokens. Its key is the chained hash of its last block (which names every
token before it) under the engine's compatibility hash (model, cache dtype, block size, layout version):

    tokens:   | blk 0 | blk 1 | blk 2 |          key = (compat, h2)
    unit:       kv 0    kv 1    kv 2   + state after 3 * block_size tokens

A `UnitCopy` names the device side (block ids, slot) and the tier side (a host block id, or the block's index in a
Mooncake object) of each block that moves; blocks the destination already holds do not move.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_SLOT = -1


@dataclass(frozen=True)
class UnitCopy:
    """One unit copied out (a store) or in (a load) on every rank, by the tier named `tier`."""

    tier: str
    request_id: str  # whose checkpoint (a store) or admission (a load) it serves
    block_hashes: tuple[int, ...]  # [num_tokens // block_size] chained hashes; the last is the unit's key
    num_tokens: int
    moves: tuple[tuple[int, int], ...]  # (device block id, tier block) of the blocks that move
    device_slot: int  # the KDA checkpoint's device slot
    tier_slot: int = NO_SLOT  # the host tier's slot (NO_SLOT for a tier keyed by name)
    tier_blocks: tuple[int, ...] = ()  # the host tier's block ids of the whole unit, held during the copy

    @property
    def key(self) -> int:
        return self.block_hashes[-1]

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


def unit_name(compat_hash: str, block_hash: int, tp_size: int, tp_rank: int) -> str:
    """A unit's name in a shared store: one object a TP rank (its KDA heads; the MLA rows every rank holds)."""
    return f"k3serve/{compat_hash[:16]}/tp{tp_size}/r{tp_rank}/{block_hash & (2**64 - 1):016x}"
