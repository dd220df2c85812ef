"""One prefill rank's part of a handoff: its writes into the decode reservation, and their checksums.

Every rank of a prefill engine owns a `RankSender` over its own cache shard and transfer agent.
For each request, all ranks push together (rank 0 announces the job through the TP group): each
rank handshakes with the decode engine once (its own agent, layout and rank), computes its share
of the writes from the TP mapping, posts them, waits until they have landed, and checksums what
it sent. Rank 0 gathers the checksums and reports to the decode side.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from k3serve.model.batch import ModelCache
from k3serve.transfer.backend import TransferBackend, TransferError, TransferStatus
from k3serve.transfer.checksum import request_checksums
from k3serve.transfer.control import DecodeControlClient, Reservation
from k3serve.transfer.layout import CacheLayout, register_cache
from k3serve.transfer.tp_map import RankCache, RequestSpan, TPMapping


@dataclass(frozen=True)
class HandoffJob:
    """What every prefill rank needs to push one request (plain values: it is broadcast)."""

    request_id: str
    decode_address: str
    src_block_ids: tuple[int, ...]  # [num_blocks] prefill blocks holding the prompt's KV
    src_slot: int  # prefill KDA slot holding the state after the prompt
    reservation: Reservation  # decode blocks + slot
    num_tokens: int


@dataclass(frozen=True)
class RankShare:
    """One rank's answer: the checksums of what it sent, or why it could not."""

    rank: int
    num_bytes: int
    checksums: dict[str, str] | None
    error: str | None = None


@dataclass
class _Peer:
    client: DecodeControlClient
    key: str
    mapping: TPMapping


class RankSender:
    def __init__(
        self, backend: TransferBackend, cache: ModelCache, layout: CacheLayout, compat_hash: str, timeout_s: float = 30.0
    ) -> None:
        self.backend, self.cache, self.layout = backend, cache, layout
        self.regions = register_cache(backend, cache)
        self.compat_hash = compat_hash
        self.timeout_s = timeout_s
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()

    def peer(self, address: str) -> _Peer:
        """Handshake once per decode engine: agent metadata, regions, layout, compatibility."""
        with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                client = DecodeControlClient(address, self.compat_hash)
                info = client.handshake(self.backend.agent_info(), self.layout.to_json(), self.layout.tp_size,
                                        self.layout.tp_rank)
                decode = RankCache(CacheLayout.from_json(info.layout_json), {r.name: r for r in info.agent.regions})
                mapping = TPMapping([RankCache(self.layout, self.regions)], [decode])
                peer = self._peers[address] = _Peer(client, self.backend.connect(info.agent), mapping)
            return peer

    def forget(self, address: str) -> None:
        """Drop a peer (it restarted or failed): the next job handshakes again."""
        with self._lock:
            peer = self._peers.pop(address, None)
        if peer is not None:
            peer.client.close()

    def push(self, job: HandoffJob) -> RankShare:
        """Write this rank's share of `job` and wait until it has landed. Never raises: a failure
        is reported in the share, so every rank still joins the gather that follows."""
        try:
            peer = self.peer(job.decode_address)
            span = RequestSpan(job.src_block_ids, job.reservation.block_ids, job.src_slot, job.reservation.slot_id,
                               job.num_tokens)
            rank = self.layout.tp_rank
            ops = peer.mapping.ops(span).get((rank, 0), [])
            self._write_and_wait(peer.key, ops)
            view = peer.mapping.view(rank, 0)
            sums = {} if view is None else request_checksums(
                self.cache, self.layout, job.src_block_ids, job.src_slot, job.num_tokens, view.heads, view.mla
            )
            return RankShare(rank, sum(op.length for op in ops), sums)
        except Exception as e:
            self.forget(job.decode_address)
            return RankShare(self.layout.tp_rank, 0, None, f"{type(e).__name__}: {e}")

    def _write_and_wait(self, peer_key: str, ops) -> None:
        if not ops:
            return
        handle = self.backend.write(peer_key, ops)
        deadline = time.monotonic() + self.timeout_s
        try:
            while (status := self.backend.poll(handle)) is TransferStatus.PENDING:
                if time.monotonic() > deadline:
                    # Memory under a write that may still land must stay pinned: the caller's
                    # lease (not this timeout) decides when it is released.
                    raise TransferError(f"writes did not land within {self.timeout_s} s")
                time.sleep(0.0001)
            if status is TransferStatus.FAILED:
                raise TransferError("the backend reported the write batch as failed")
        finally:
            self.backend.release(handle)

    def close(self) -> None:
        for address in list(self._peers):
            self.forget(address)
        self.backend.close()
