"""The scheduler's side of the offload tiers: which copies the next step runs, and the device blocks and slots
they read or fill (scheduler thread, no tensors).

    store   a prompt's KDA checkpoint was taken (`checkpointed`): every tier begins a copy of the unit; the
            device blocks it reads and the slot are PINNED until the step that copies them ends (a pinned block
            is never handed out, so nothing overwrites it first, a decode reservation's landing writes included)
    load    a waiting request whose longest unit sits in a tier, longer than the device's hit (`start_load`):
            the device blocks the device still caches are shared, fresh ones and a slot allocated, the tier's
            entries held; the request waits one step; a verified load registers the blocks and the checkpoint in
            the device prefix cache and becomes the request's hit (`take_loaded`), refs held until it is admitted
    miss    a load that did not verify (any rank): its fresh blocks and slot go back, unregistered, the tier
            forgets the unit, and the request is admitted from the device's hit alone (`no_offload`)

Only tiers with `restores_kda_state` are accepted: a KV-only hit on a hybrid model is wrong output, silently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from k3serve.engine.block_pool import BlockPool, compute_block_hashes
from k3serve.engine.offload.metrics import TierCounts, offload_metrics
from k3serve.engine.offload.tier import TierIndex
from k3serve.engine.offload.unit import UnitCopy
from k3serve.engine.prefix_cache import PrefixCache, PrefixHit
from k3serve.engine.state_pool import StatePool


@dataclass
class _Load:
    block_ids: list[int]  # [num_blocks] the unit's device blocks (shared or fresh), refs held
    slot_id: int  # the device slot the checkpoint lands in, ref held
    token_ids: list[int]  # [num_blocks * block_size] the unit's tokens (the KV events of the blocks it registers)


class Offload:
    def __init__(self, tiers: Sequence[TierIndex], prefix_cache: PrefixCache, model_name: str = "") -> None:
        for tier in tiers:
            if not tier.restores_kda_state:
                raise ValueError(f"offload tier {tier.name!r} does not restore the KDA state: on a hybrid model its "
                                 "hits would be wrong output")
        self.tiers = {tier.name: tier for tier in tiers}
        self.prefix_cache = prefix_cache
        self.blocks: BlockPool = prefix_cache.block_pool
        self.slots: StatePool = prefix_cache.state_pool
        self.block_size = self.blocks.block_size
        metrics = offload_metrics()
        self.counts = {name: TierCounts(metrics, model_name, name) for name in self.tiers}
        self._stores: list[UnitCopy] = []  # begun, for the next step
        self._loads: list[UnitCopy] = []  # begun this schedule(), for its step
        self._loading: dict[str, _Load] = {}  # request id -> its load's device side, until the step ends
        self._loaded: dict[str, PrefixHit] = {}  # request id -> a verified load, refs held until admitted
        self.no_offload: set[str] = set()  # requests whose load missed: admitted without asking the tiers again
        self._queried: set[str] = set()  # requests counted in the tiers' queries (once each, as the device's hits)

    @property
    def has_pending(self) -> bool:
        """Copies begun that no step has run yet (the engine runs one more step for them)."""
        return bool(self._stores or self._loads)

    # ---- stores ------------------------------------------------------------------------------------------
    def checkpointed(self, request_id: str, block_hashes: Sequence[int], block_ids: Sequence[int], slot_id: int) -> None:
        """A checkpoint of `len(block_hashes)` blocks was registered: copy the unit to every tier that lacks it."""
        for tier in self.tiers.values():
            op = tier.begin_store(request_id, block_hashes, block_ids[: len(block_hashes)], slot_id)
            if op is not None:
                self.blocks.pin([d for d, _ in op.moves])
                self.slots.pin(slot_id)
                self._stores.append(op)

    # ---- loads -------------------------------------------------------------------------------------------
    def start_load(self, request_id: str, token_ids: Sequence[int], device_hit_tokens: int) -> bool:
        """Begin loading the longest unit of `token_ids`' prefix that a tier holds, if longer than the device's hit
        (and strictly shorter than the tokens); True if a load was begun (the request waits for it)."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = compute_block_hashes(token_ids[: max_blocks * self.block_size], self.block_size)
        best: tuple[TierIndex, int] | None = None
        first_ask = request_id not in self._queried
        self._queried.add(request_id)
        for tier in self.tiers.values():
            if first_ask:
                self.counts[tier.name].query(len(token_ids))
            num_blocks = tier.lookup(hashes)
            if num_blocks * self.block_size > max(device_hit_tokens, best[1] * self.block_size if best else 0):
                best = (tier, num_blocks)
        if best is None:
            return False
        tier, num_blocks = best
        hashes = hashes[:num_blocks]
        block_ids = [self.blocks.get_cached_block(h) for h in hashes]
        present = [b for b in block_ids if b is not None]
        self.blocks.share(present)  # before allocating, so the allocation cannot evict them
        fresh_at = [i for i, b in enumerate(block_ids) if b is None]
        if not (self.blocks.can_allocate(len(fresh_at)) and self.slots.can_allocate(1)):
            self.blocks.free(present)
            return False
        fresh = self.blocks.allocate(len(fresh_at))
        for i, block_id in zip(fresh_at, fresh):
            block_ids[i] = block_id
        slot_id = self.slots.allocate()
        op = tier.begin_load(request_id, hashes, list(zip(fresh, fresh_at)), slot_id)
        if op is None:
            self._free(block_ids, slot_id)
            return False
        self._loading[request_id] = _Load(block_ids, slot_id, list(token_ids[: num_blocks * self.block_size]))
        self._loads.append(op)
        return True

    def take_loaded(self, request_id: str) -> PrefixHit | None:
        """The request's verified load, whose refs the caller now owns; None if it has none."""
        return self._loaded.pop(request_id, None)

    def keep_loaded(self, request_id: str, hit: PrefixHit) -> None:
        """Hand back a loaded hit the request could not be admitted with yet."""
        self._loaded[request_id] = hit

    def release(self, request_id: str) -> None:
        """The request ended: free a loaded hit it still holds."""
        self.no_offload.discard(request_id)
        self._queried.discard(request_id)
        hit = self._loaded.pop(request_id, None)
        if hit is not None:
            self._free(hit.block_ids, hit.checkpoint_slot)

    # ---- the step ----------------------------------------------------------------------------------------
    def take_ops(self) -> tuple[list[UnitCopy], list[UnitCopy]]:
        """The stores and loads the step being scheduled runs."""
        ops = self._stores, self._loads
        self._stores, self._loads = [], []
        return ops

    def step_done(self, stores: Sequence[UnitCopy], loads: Sequence[UnitCopy], results: Sequence[int | None],
                  waiting: Callable[[str], bool]) -> None:
        """The step ran `stores` then `loads`; `results` (one per op, in that order): bytes moved on all ranks,
        None where a rank failed. `waiting(request_id)`: the request still waits for its admission."""
        if len(results) != len(stores) + len(loads):
            raise ValueError(f"{len(results)} offload results for {len(stores)} stores and {len(loads)} loads")
        for op, num_bytes in zip(stores, results):
            self.tiers[op.tier].end_store(op, num_bytes is not None)
            self.blocks.unpin([d for d, _ in op.moves])
            self.slots.unpin(op.device_slot)
            if num_bytes is not None:
                self.counts[op.tier].stored(num_bytes)
        for op, num_bytes in zip(loads, results[len(stores):]):
            load = self._loading.pop(op.request_id)
            ok = num_bytes is not None
            self.tiers[op.tier].end_load(op, ok)
            self.counts[op.tier].loaded(op.num_tokens, num_bytes)
            if ok and waiting(op.request_id):
                self.prefix_cache.insert(op.block_hashes, load.block_ids, op.num_tokens, load.slot_id, load.token_ids)
                self._loaded[op.request_id] = PrefixHit(op.num_tokens, load.block_ids, load.slot_id)
                continue
            self._free(load.block_ids, load.slot_id)
            if not ok:
                self.no_offload.add(op.request_id)

    def _free(self, block_ids: Sequence[int], slot_id: int) -> None:
        self.blocks.free(block_ids)
        self.slots.free(slot_id)
