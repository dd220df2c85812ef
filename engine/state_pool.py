"""Slot ids of the KDA state cache (recurrent `[H/tp, 128, 128]` fp32 + conv window per layer).

Ids only; the tensors live in the model's cache. A slot is either a request's WORKING slot
(advanced once per token while the request runs) or a CHECKPOINT slot: the state at a block
boundary of some prefix, owned by the prefix cache under that prefix's chained block hash.

    slot id:    0     1     2     3     4     5     6     7
    ref+pin:    1     0     1+1p  0     0     1     0     0      (p = pinned by a transfer)
    key:        -     k9    k4    -     k2    -     -     -
                work  ckpt  ckpt  free  ckpt  work  free  free
                      (LRU) (in use:          (LRU)
                             a hit is
                             copying it)

    in use   ref_count + pin_count > 0    never evicted, never handed out by allocate()
    cached   unused checkpoint (has key)  found by `lookup(key)`; evicted LRU-first
    free     unused, no key               handed out first

`num_free` counts free + cached. Pins are counts held by in-flight transfers (boundary state
written to a decode peer or offloaded); a pinned slot is never reallocated, and one released by
`free()` while pinned comes back when the last pin goes.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need num_slots >= 1, got num_slots={num_slots}")
        self.num_slots = num_slots
        self._ref_counts = [0] * num_slots  # [num_slots]
        self._pin_counts = [0] * num_slots  # [num_slots]
        self._slot_key: list[int | None] = [None] * num_slots  # [num_slots] checkpoint key
        self._key_to_slot: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_slots))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unused checkpoints, oldest first

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    @property
    def num_cached(self) -> int:
        """Unused checkpoint slots still reusable by a prefix hit."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_slots

    def can_allocate(self, num_slots: int = 1) -> bool:
        return num_slots <= self.num_free

    def ref_count(self, slot_id: int) -> int:
        return self._ref_counts[slot_id]

    def pin_count(self, slot_id: int) -> int:
        return self._pin_counts[slot_id]

    def lookup(self, key: int) -> int | None:
        """The checkpoint slot stored under `key` (in use or cached), or None."""
        return self._key_to_slot.get(key)

    # ---- ownership -----------------------------------------------------------------------
    def allocate(self) -> int:
        """A fresh slot with ref count 1: a free one, else evict the least recently used checkpoint."""
        if self._free:
            slot_id = self._free.popleft()
        elif self._cached:
            slot_id, _ = self._cached.popitem(last=False)
            del self._key_to_slot[self._slot_key[slot_id]]
            self._slot_key[slot_id] = None
        else:
            raise RuntimeError(f"cannot allocate a KDA state slot: all {self.num_slots} are in use")
        self._ref_counts[slot_id] = 1
        return slot_id

    def share(self, slot_id: int) -> None:
        """One more ref on a slot in use or a cached checkpoint (held while a hit copies it)."""
        if not self._in_use(slot_id):
            if slot_id not in self._cached:
                raise ValueError(f"cannot share slot {slot_id}: it is free and holds no checkpoint")
            del self._cached[slot_id]
        self._ref_counts[slot_id] += 1

    def free(self, slot_id: int) -> None:
        if self._ref_counts[slot_id] <= 0:
            raise ValueError(f"double free of slot {slot_id}")
        self._ref_counts[slot_id] -= 1
        self._release_if_unused(slot_id)

    def pin(self, slot_id: int) -> None:
        """Hold a slot for an in-flight transfer; it survives `free()` until `unpin()`."""
        if not self._in_use(slot_id):
            if slot_id not in self._cached:
                raise ValueError(f"cannot pin slot {slot_id}: it is not allocated")
            del self._cached[slot_id]
        self._pin_counts[slot_id] += 1

    def unpin(self, slot_id: int) -> None:
        if self._pin_counts[slot_id] <= 0:
            raise ValueError(f"unpin of slot {slot_id} that is not pinned")
        self._pin_counts[slot_id] -= 1
        self._release_if_unused(slot_id)

    # ---- checkpoints ---------------------------------------------------------------------
    def cache_checkpoint(self, slot_id: int, key: int) -> bool:
        """Hand an in-use slot holding a boundary state to the prefix cache under `key`.

        The owner still frees its ref as usual; the slot then stays reusable until evicted.
        False (nothing changes) if `key` is already held by another slot or the slot has a key.
        """
        if not self._in_use(slot_id):
            raise ValueError(f"cannot cache slot {slot_id}: it is not in use")
        if key in self._key_to_slot or self._slot_key[slot_id] is not None:
            return self._key_to_slot.get(key) == slot_id
        self._slot_key[slot_id] = key
        self._key_to_slot[key] = slot_id
        return True

    def forget(self, key: int) -> bool:
        """Stop finding the checkpoint under `key` (its bytes are not to be trusted): an unused slot becomes free,
        one in use stays its holders' until they free it. False if no slot holds `key`."""
        slot_id = self._key_to_slot.pop(key, None)
        if slot_id is None:
            return False
        self._slot_key[slot_id] = None
        if slot_id in self._cached:
            del self._cached[slot_id]
            self._free.append(slot_id)
        return True

    def evict_all_cached(self) -> int:
        """Drop every unused checkpoint (they become plain free); returns the count."""
        num_evicted = len(self._cached)
        while self._cached:
            slot_id, _ = self._cached.popitem(last=False)
            del self._key_to_slot[self._slot_key[slot_id]]
            self._slot_key[slot_id] = None
            self._free.append(slot_id)
        return num_evicted

    # ---- leak checks ---------------------------------------------------------------------
    def check_empty(self) -> None:
        """Raise AssertionError if any slot is still referenced or pinned."""
        leaked = [s for s in range(self.num_slots) if self._in_use(s)]
        if leaked:
            detail = {s: (self._ref_counts[s], self._pin_counts[s]) for s in leaked[:16]}
            raise AssertionError(f"{len(leaked)} slots still in use, (ref, pin) by id: {detail}")
        assert self.num_free == self.num_slots, (self.num_free, self.num_slots)

    # ---- internals -----------------------------------------------------------------------
    def _in_use(self, slot_id: int) -> bool:
        return self._ref_counts[slot_id] > 0 or self._pin_counts[slot_id] > 0

    def _release_if_unused(self, slot_id: int) -> None:
        if self._in_use(slot_id):
            return
        if self._slot_key[slot_id] is not None:
            self._cached[slot_id] = None
        else:
            self._free.append(slot_id)
