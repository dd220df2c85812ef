"""Prefix reuse for a hybrid model: MLA blocks plus a KDA checkpoint at the same boundary.

A prefix of n*block_size tokens is reusable only if BOTH survive:

    tokens:      | blk 0 | blk 1 | blk 2 | blk 3 | blk 4 | ...
    block pool:    h0      h1      h2      h3      -         (chained hashes of full blocks)
    state pool:                   [k=h2]                     (KDA state after 3 blocks)
                                     ^ the only valid hit here: 3 blocks, checkpoint under h2

MLA blocks alone cannot resume the model (the KDA layers need their recurrent and conv state
at exactly that token), so the hit length is the LAST boundary whose blocks are all cached and
whose chained hash keys a checkpoint slot. It is also strictly shorter than the looked-up
tokens, so at least one token is computed and sampled from.

The pools own the bookkeeping (hash -> block in `BlockPool`, hash -> checkpoint slot in
`StatePool`) and evict unused entries LRU-first when they need room; this class only combines
them. An evicted block or checkpoint simply stops matching, and `clear()` evicts everything
unused back to the pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from k3serve.engine.block_pool import BlockPool, compute_block_hashes
from k3serve.engine.state_pool import StatePool

if TYPE_CHECKING:
    from k3serve.engine.kv_events import KVEventPublisher


class PrefixHit(NamedTuple):
    num_tokens: int  # block-aligned, < len(token_ids); 0 on a miss
    block_ids: list[int]  # [num_tokens // block_size]
    checkpoint_slot: int  # KDA state after num_tokens tokens; -1 on a miss


MISS = PrefixHit(0, [], -1)


class PrefixCache:
    def __init__(self, block_pool: BlockPool, state_pool: StatePool) -> None:
        self.block_pool = block_pool
        self.state_pool = state_pool
        self.block_size = block_pool.block_size
        self.num_lookups = 0
        self.num_hits = 0
        self.events: KVEventPublisher | None = None

    def publish_events(self, publisher: KVEventPublisher) -> None:
        """Report blocks stored (by `insert`) and removed (evicted by the block pool) to `publisher`."""
        self.events = publisher
        self.block_pool.on_evicted = publisher.block_removed

    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        """Longest reusable prefix of `token_ids`. Takes no refs: the caller shares what it uses."""
        self.num_lookups += 1
        max_blocks = (len(token_ids) - 1) // self.block_size  # leave >= 1 token to compute
        block_hashes = compute_block_hashes(token_ids[: max_blocks * self.block_size], self.block_size)
        block_ids: list[int] = []
        best = MISS
        for block_hash in block_hashes:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
            slot_id = self.state_pool.lookup(block_hash)
            if slot_id is not None:
                best = PrefixHit(len(block_ids) * self.block_size, list(block_ids), slot_id)
        if best.num_tokens:
            self.num_hits += 1
        return best

    def has_boundary(self, block_hashes: Sequence[int], boundary_num_tokens: int) -> bool:
        """True if the prefix of `boundary_num_tokens` tokens is already reusable."""
        num_blocks = boundary_num_tokens // self.block_size
        if num_blocks == 0 or self.state_pool.lookup(block_hashes[num_blocks - 1]) is None:
            return False
        return all(self.block_pool.get_cached_block(h) is not None for h in block_hashes[:num_blocks])

    def insert(
        self,
        block_hashes: Sequence[int],  # [>= boundary_num_tokens // block_size] chained hashes
        block_ids: Sequence[int],  # [>= boundary_num_tokens // block_size] the request's table
        boundary_num_tokens: int,
        checkpoint_slot: int,
        token_ids: Sequence[int] = (),  # [>= boundary_num_tokens] the prompt, for the stored blocks' KV events
    ) -> bool:
        """Register the blocks up to the boundary and the KDA checkpoint taken there.

        The blocks and the slot must be in use (the inserting request holds them); they become
        reusable once it frees them. Returns False if an equal checkpoint was already cached,
        in which case this slot is not kept (the caller's free() then returns it to the pool).
        """
        if boundary_num_tokens <= 0 or boundary_num_tokens % self.block_size:
            raise ValueError(
                f"boundary_num_tokens must be a positive multiple of block_size={self.block_size}, "
                f"got {boundary_num_tokens}"
            )
        num_blocks = boundary_num_tokens // self.block_size
        if len(block_hashes) < num_blocks or len(block_ids) < num_blocks:
            raise ValueError(
                f"boundary {boundary_num_tokens} needs {num_blocks} blocks, got "
                f"{len(block_hashes)} hashes and {len(block_ids)} block ids"
            )
        stored = []  # indices of the blocks that got their hash now
        for i, (block_id, block_hash) in enumerate(zip(block_ids[:num_blocks], block_hashes[:num_blocks])):
            new = self.block_pool.get_cached_block(block_hash) is None
            if self.block_pool.cache_block(block_id, block_hash) and new:  # an equal block may already hold it
                stored.append(i)
        if self.events is not None and stored:
            self._publish_stored(block_hashes, token_ids, stored)
        return self.state_pool.cache_checkpoint(checkpoint_slot, block_hashes[num_blocks - 1])

    def _publish_stored(self, block_hashes: Sequence[int], token_ids: Sequence[int], stored: list[int]) -> None:
        """One BlockStored per run of consecutive newly stored blocks, with its parent's hash and its tokens."""
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        size = self.block_size
        for run in runs:
            self.events.block_stored([block_hashes[i] for i in run], block_hashes[run[0] - 1] if run[0] else None,
                                     token_ids[run[0] * size:(run[-1] + 1) * size])

    def clear(self) -> None:
        """Evict every unused cached block and checkpoint back to the pools."""
        self.block_pool.evict_all_cached()
        self.state_pool.evict_all_cached()
