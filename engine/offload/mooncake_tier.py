"""The Mooncake Store tier: prefix units in the distributed store every replica that names its master shares (the
`mooncake` package's `MooncakeDistributedStore`, its master started as the package documents).

One object a unit and TP rank (`unit.unit_name`: compatibility hash, TP size, rank, boundary hash): a header (JSON:
each block's checksum and the slot's) and the unit's bytes, every MLA layer's rows of its blocks, then the KDA state.
A replica puts what it checkpoints (write-through, the step after); any replica looks a prompt's boundaries up
(`batch_is_exist`, rank 0, every rank's object) and gets a hit the way the host tier's are: fresh device blocks, a
slot, the copy at the start of a step, the checksums of what landed. An object gone between lookup and get (its lease
expired, evicted), a short or corrupted one, a store that is down or slower than `timeout_s`: a miss, recomputed.

Store calls run on one thread of the tier's own (`_Calls`); a call past the timeout is abandoned, and while it is
still stuck every later call fails at once, so a hung store costs one timeout, not one a step.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from k3serve.engine.offload.copy import block_bytes, slot_bytes
from k3serve.engine.offload.mooncake_config import MooncakeStoreConfig
from k3serve.engine.offload.unit import UnitCopy, unit_name
from k3serve.model.batch import ModelCache
from k3serve.transfer.checksum import block_checksums, slot_checksum

TIER = "mooncake"
_HEADER = struct.Struct("<Q")  # the header's length, then the header, then the payload
T = TypeVar("T")


class _Calls:
    """Store calls on one worker thread, each bounded by `timeout_s`; None for a call that failed or timed out."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="k3serve-mooncake")
        self._stuck: concurrent.futures.Future | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], T]) -> T | None:
        with self._lock:
            if self._stuck is not None and not self._stuck.done():
                return None  # the store has not answered the last call yet: a miss now, not another wait
            try:
                future = self._pool.submit(fn)
            except RuntimeError:  # closed
                return None
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._stuck = future
            return None
        except Exception:  # the store refused or broke: a miss
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class MooncakeClient:
    """One process's store client (rank 0's serves its index and its data alike), set up on construction."""

    def __init__(self, config: MooncakeStoreConfig) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.config = config
        self.closed = False
        self.calls = _Calls(config.timeout_s)
        self.store = MooncakeDistributedStore()
        host = config.local_hostname or os.environ.get("K3SERVE_HOST_IP") or "127.0.0.1"
        rc = self.calls.run(lambda: self.store.setup(host, config.metadata_server, config.global_segment_size,
                                                     config.local_buffer_size, config.protocol, config.device_name,
                                                     config.master_server_addr))
        if rc != 0:
            raise RuntimeError(f"Mooncake Store client setup failed (rc={rc}) with master {config.master_server_addr} "
                               f"and metadata server {config.metadata_server}")

    def close(self) -> None:
        """Leave the store (once; later calls fail as a store that is down does)."""
        if not self.closed:
            self.closed = True
            self.calls.run(self.store.close)
            self.calls.close()


class MooncakeIndex:
    """The scheduler's half (rank 0): which units the store holds for every rank of this engine."""

    name = TIER
    restores_kda_state = True

    def __init__(self, client: MooncakeClient, compat_hash: str, tp_size: int, block_size: int) -> None:
        self.client, self.compat_hash, self.tp_size, self.block_size = client, compat_hash, tp_size, block_size

    def lookup(self, block_hashes: Sequence[int]) -> int:
        if not block_hashes:
            return 0
        names = [unit_name(self.compat_hash, h, self.tp_size, r) for h in block_hashes for r in range(self.tp_size)]
        found = self.client.calls.run(lambda: self.client.store.batch_is_exist(names))
        if found is None or len(found) != len(names):
            return 0
        for i in range(len(block_hashes), 0, -1):
            if all(v == 1 for v in found[(i - 1) * self.tp_size : i * self.tp_size]):
                return i
        return 0

    def begin_store(self, request_id: str, block_hashes: Sequence[int], device_block_ids: Sequence[int],
                    device_slot: int) -> UnitCopy:
        moves = tuple((d, i) for i, d in enumerate(device_block_ids))
        return UnitCopy(TIER, request_id, tuple(block_hashes), len(block_hashes) * self.block_size, moves, device_slot)

    def end_store(self, op: UnitCopy, ok: bool) -> None:
        pass  # the store holds it (or not) by itself

    def begin_load(self, request_id: str, block_hashes: Sequence[int], fresh: Sequence[tuple[int, int]],
                   device_slot: int) -> UnitCopy:
        return UnitCopy(TIER, request_id, tuple(block_hashes), len(block_hashes) * self.block_size, tuple(fresh),
                        device_slot)

    def end_load(self, op: UnitCopy, ok: bool) -> None:
        pass  # a bad object may be another rank's only: it is left to the store's eviction


class MooncakeData:
    """One rank's half: its unit objects put and got (engine thread)."""

    name = TIER

    def __init__(self, client: MooncakeClient, device: ModelCache, compat_hash: str, tp_size: int, tp_rank: int) -> None:
        self.client, self.compat_hash, self.tp_size, self.tp_rank = client, compat_hash, tp_size, tp_rank
        self.bytes_per_block, self.bytes_per_slot = block_bytes(device), slot_bytes(device)

    def close(self) -> None:
        self.client.close()

    def _name(self, op: UnitCopy) -> str:
        return unit_name(self.compat_hash, op.key, self.tp_size, self.tp_rank)

    def store(self, op: UnitCopy, device: ModelCache) -> int | None:
        ids = [d for d, _ in op.moves]
        header = json.dumps({"blocks": block_checksums(device, ids), "slot": slot_checksum(device, op.device_slot),
                             "num_blocks": len(ids)}).encode()
        payload = _unit_bytes(device, ids, op.device_slot)
        value = _HEADER.pack(len(header)) + header + payload.numpy().tobytes()
        name = self._name(op)
        rc = self.client.calls.run(lambda: self.client.store.put(name, value))
        if rc is None or (rc != 0 and self.client.calls.run(lambda: self.client.store.is_exist(name)) != 1):
            return None
        return len(value)

    def load(self, op: UnitCopy, device: ModelCache) -> int | None:
        name = self._name(op)
        value = self.client.calls.run(lambda: self.client.store.get(name))
        parsed = _parse(value, op.num_blocks, self.bytes_per_block, self.bytes_per_slot)
        if parsed is None:
            return None  # gone (lease expired, evicted), short, or not ours
        header, payload = parsed
        blocks, slot = _split(payload, device, op.num_blocks)
        fresh = [d for d, _ in op.moves]
        for kv, rows in zip(device.mla_kv, blocks):
            if fresh:
                kv.index_copy_(0, torch.tensor(fresh, device=kv.device),
                               rows[[i for _, i in op.moves]].to(kv.device))
        for pool, state in zip(device.kda_recurrent + device.kda_conv, slot):
            pool[op.device_slot].copy_(state)
        if block_checksums(device, fresh) != [header["blocks"][i] for _, i in op.moves]:
            return None
        if slot_checksum(device, op.device_slot) != header["slot"]:
            return None
        return len(value)


def _unit_bytes(device: ModelCache, block_ids: Sequence[int], slot_id: int) -> torch.Tensor:
    """uint8 on the host: every MLA layer's rows of `block_ids`, then the slot's state in every KDA pool."""
    parts = [kv[torch.tensor(block_ids, device=kv.device)].cpu() for kv in device.mla_kv]
    parts += [pool[slot_id].cpu() for pool in device.kda_recurrent + device.kda_conv]
    return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])


def _parse(value: Any, num_blocks: int, per_block: int, per_slot: int) -> tuple[dict, torch.Tensor] | None:
    """(header, payload) of a unit object of `num_blocks` blocks; None if it is missing, short or malformed."""
    if not isinstance(value, (bytes, bytearray)) or len(value) < _HEADER.size:
        return None
    (length,) = _HEADER.unpack_from(value)
    start = _HEADER.size + length
    if len(value) - start != num_blocks * per_block + per_slot:
        return None
    try:
        header = json.loads(value[_HEADER.size : start])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if (not isinstance(header, dict) or header.get("num_blocks") != num_blocks or not isinstance(header.get("slot"), str)
            or not isinstance(header.get("blocks"), list) or len(header["blocks"]) != num_blocks
            or not all(isinstance(v, str) for v in header["blocks"])):
        return None
    return header, torch.frombuffer(bytearray(value[start:]), dtype=torch.uint8)


def _split(payload: torch.Tensor, like: ModelCache, num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The payload as every MLA layer's [num_blocks, block_size, dim] rows and every KDA pool's one-slot state."""
    out: list[torch.Tensor] = []
    at = 0
    for t, n in [(kv, num_blocks) for kv in like.mla_kv] + [(p, 1) for p in like.kda_recurrent + like.kda_conv]:
        shape = (n, *t.shape[1:])
        nbytes = t.element_size() * int(torch.Size(shape).numel())
        out.append(payload[at : at + nbytes].view(t.dtype).view(shape))
        at += nbytes
    num_mla = len(like.mla_kv)
    return out[:num_mla], [s[0] for s in out[num_mla:]]
