"""What a tier is: its scheduler half (`TierIndex`: which units it holds, and the bookkeeping of a copy) and its
runner half (`TierData`: the bytes, on every TP rank), the shape of vLLM's `OffloadingManager`
(`vllm/v1/kv_offload/abstract.py`) split at the scheduler / runner boundary as k3serve's pools are.

A copy is begun by the scheduler (`begin_store` / `begin_load`: the tier holds what the copy reads or writes), run by
every rank's runner at the start of the next step (`TierData.store` / `load`, before the forward pass writes a block
or a slot), and ended by the scheduler after that step (`end_store` / `end_load`). A load the runner could not verify
(a checksum mismatch on any rank, an entry gone, a store down) is a miss: `end_load(op, ok=False)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from k3serve.engine.offload.unit import UnitCopy

if TYPE_CHECKING:
    from k3serve.model.batch import ModelCache


class TierIndex(Protocol):
    name: str
    restores_kda_state: bool  # False: KV without the KDA checkpoint, never a hit on a hybrid model

    def lookup(self, block_hashes: Sequence[int]) -> int:
        """Blocks of the longest whole unit held among the prefixes of `block_hashes` (0: none)."""

    def begin_store(self, request_id: str, block_hashes: Sequence[int], device_block_ids: Sequence[int],
                    device_slot: int) -> UnitCopy | None:
        """A copy out of the unit `block_hashes` (its blocks `device_block_ids`, its checkpoint `device_slot`);
        None if the tier holds it already or has no room."""

    def end_store(self, op: UnitCopy, ok: bool) -> None:
        """The runners copied `op` out (`ok`: it may answer lookups from now on) or could not (on some rank)."""

    def begin_load(self, request_id: str, block_hashes: Sequence[int], fresh: Sequence[tuple[int, int]],
                   device_slot: int) -> UnitCopy | None:
        """A copy in of the unit `block_hashes` into `device_slot` and the fresh device blocks `fresh`
        ((device block id, index in the unit)); None if it is gone."""

    def end_load(self, op: UnitCopy, ok: bool) -> None:
        """The runners copied `op` in (`ok`) or could not (a miss: the tier forgets the unit)."""


class TierData(Protocol):
    name: str

    def store(self, op: UnitCopy, device: ModelCache) -> int | None:
        """Copy the unit out of `device` (this rank's cache); the bytes moved, None if the tier did not take it."""

    def load(self, op: UnitCopy, device: ModelCache) -> int | None:
        """Copy the unit into `device` and verify what landed; the bytes moved, None if it did not verify."""

    def close(self) -> None:
        """Release what the tier holds outside the process's memory (a store client)."""
