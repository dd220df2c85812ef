"""Block ids of the paged MLA latent KV cache: ref counts, pins, and prefix-hash reuse.

Ids only; the `[num_blocks, block_size, 512 + 64]` tensors live in the model's cache. Every
block is in exactly one of three states:

    block id:   0    1    2    3    4    5    6    7    8    9
    ref+pin:    1    2    0    0    1p   0    0    1    0    0     (p = pinned by a transfer)
    hash:       h0   h1   -    h5   -    h7   -    -    -    h9
                in use    |    |    in use    |    in use    |
                          free cached         free cached    cached
                          (LRU, reusable)                    (LRU, reusable)

    in use  ref_count + pin_count > 0     never evicted, never handed out by allocate()
    cached  unused, has a prefix hash     reusable by a later prefix hit; evicted LRU-first
    free    unused, no hash               handed out first

`num_free_blocks` counts free + cached (both can be allocated). A block's hash is the chained
prefix hash of a FULL block, `hash((parent_hash, tuple(block_tokens)))`, so equal hashes mean
equal token prefixes. Pins are ref counts held by in-flight transfers (KV written to a decode
peer or offloaded): `free()` drops the owner's ref, and a pinned block comes back only when the
last pin is released by `unpin()`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

NO_PARENT_HASH = 0  # parent of the first block of a sequence


def hash_block_tokens(parent_hash: int, block_token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: equal hashes <=> equal token prefixes (up to collisions).

    Python's hash of a tuple of ints does not depend on PYTHONHASHSEED, so it is stable
    across processes of one Python version.
    """
    return hash((parent_hash, tuple(block_token_ids)))


def compute_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`: [len(token_ids) // block_size]."""
    hashes: list[int] = []
    parent = NO_PARENT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks  # [num_blocks] owners (requests, prefix hits)
        self._pin_counts = [0] * num_blocks  # [num_blocks] in-flight transfers
        self._block_hash: list[int | None] = [None] * num_blocks  # [num_blocks]
        self._hash_to_block: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_blocks))  # unused, no hash
        self._cached: OrderedDict[int, None] = OrderedDict()  # unused, hashed; oldest first
        self.on_evicted: Callable[[list[int]], None] | None = None
        """Called with the hashes an `allocate` or `evict_all_cached` dropped (KV events, engine/kv_events.py)."""

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Unused blocks that still hold a reusable prefix."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def pin_count(self, block_id: int) -> int:
        return self._pin_counts[block_id]

    def get_cached_block(self, block_hash: int) -> int | None:
        """The block holding this prefix hash (in use or cached), or None."""
        return self._hash_to_block.get(block_hash)

    # ---- ownership -----------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks with ref count 1: free ones first, then evict cached ones LRU-first."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"cannot allocate {num_blocks} blocks: {self.num_free_blocks} free of {self.num_blocks}")
        block_ids, evicted = [], []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._cached.popitem(last=False)
                evicted.append(self._drop_hash(block_id))
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        if evicted and self.on_evicted is not None:
            self.on_evicted(evicted)
        return block_ids

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more ref on blocks that are in use or cached (a prefix hit)."""
        for block_id in block_ids:
            if not self._in_use(block_id):
                if block_id not in self._cached:
                    raise ValueError(f"cannot share block {block_id}: it is free and holds no prefix")
                del self._cached[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one ref on each block. Freed in reverse, so a sequence's tail is evicted first."""
        for block_id in reversed(block_ids):
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"double free of block {block_id}")
            self._ref_counts[block_id] -= 1
            self._release_if_unused(block_id)

    def pin(self, block_ids: Sequence[int]) -> None:
        """Hold blocks for an in-flight transfer; they survive `free()` until `unpin()`."""
        for block_id in block_ids:
            if not self._in_use(block_id):
                if block_id not in self._cached:
                    raise ValueError(f"cannot pin block {block_id}: it is not allocated")
                del self._cached[block_id]
            self._pin_counts[block_id] += 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        for block_id in reversed(block_ids):
            if self._pin_counts[block_id] <= 0:
                raise ValueError(f"unpin of block {block_id} that is not pinned")
            self._pin_counts[block_id] -= 1
            self._release_if_unused(block_id)

    # ---- prefix hashes -------------------------------------------------------------------
    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a FULL in-use block under its chained hash. False if the hash is already held
        by another block (the block then stays unhashed) or the block already has a hash."""
        if not self._in_use(block_id):
            raise ValueError(f"cannot cache block {block_id}: it is not in use")
        if block_hash in self._hash_to_block or self._block_hash[block_id] is not None:
            return self._hash_to_block.get(block_hash) == block_id
        self._block_hash[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def evict_all_cached(self) -> int:
        """Drop every unused cached block's hash (they become plain free); returns the count."""
        evicted = []
        while self._cached:
            block_id, _ = self._cached.popitem(last=False)
            evicted.append(self._drop_hash(block_id))
            self._free.append(block_id)
        if evicted and self.on_evicted is not None:
            self.on_evicted(evicted)
        return len(evicted)

    # ---- leak checks ---------------------------------------------------------------------
    def check_empty(self) -> None:
        """Raise AssertionError if any block is still referenced or pinned."""
        leaked = [b for b in range(self.num_blocks) if self._in_use(b)]
        if leaked:
            detail = {b: (self._ref_counts[b], self._pin_counts[b]) for b in leaked[:16]}
            raise AssertionError(f"{len(leaked)} blocks still in use, (ref, pin) by id: {detail}")
        assert self.num_free_blocks == self.num_blocks, (self.num_free_blocks, self.num_blocks)

    # ---- internals -----------------------------------------------------------------------
    def _in_use(self, block_id: int) -> bool:
        return self._ref_counts[block_id] > 0 or self._pin_counts[block_id] > 0

    def _drop_hash(self, block_id: int) -> int:
        block_hash = self._block_hash[block_id]
        del self._hash_to_block[block_hash]
        self._block_hash[block_id] = None
        return block_hash

    def _release_if_unused(self, block_id: int) -> None:
        if self._in_use(block_id):
            return
        if self._block_hash[block_id] is not None:
            self._cached[block_id] = None  # most recently used end
        else:
            self._free.append(block_id)
