"""One prefill rank's part of a handoff: its writes into the decode reservation, and their checksums.

Every rank of a prefill engine owns a `RankSender` over its own cache shard and transfer agent; all ranks push
a request together (rank 0 announces it). A rank handshakes once with every decode rank, posts one batch of
TP-mapped writes per decode rank it feeds, checksums what it sent while they fly (the source is pinned), and
waits until all have landed; rank 0 gathers the sums for decode rank 0. Drawn: docs/design/handoff.md §3.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from k3serve.model.batch import ModelCache
from k3serve.transfer.auth import ControlAuth
from k3serve.transfer.backend import TransferBackend, TransferError, TransferStatus
from k3serve.transfer.checksum import CachedRequest, views_checksums
from k3serve.transfer.control import DecodeControlClient, Reservation
from k3serve.transfer.layout import CacheLayout, register_cache
from k3serve.transfer.tp_map import RankCache, RequestSpan, TPMapping

Addresses = tuple[str, ...]  # a decode engine: its ranks' control addresses, rank order
T = TypeVar("T")


@dataclass(frozen=True)
class HandoffJob:
    """What every prefill rank needs to push one request (plain values: it is broadcast)."""

    request_id: str
    decode_addresses: Addresses
    src_block_ids: tuple[int, ...]  # [num_blocks] prefill blocks holding the prompt's KV
    src_slot: int  # prefill KDA slot holding the state after the prompt
    reservation: Reservation  # decode blocks + slot
    num_tokens: int


@dataclass(frozen=True)
class RankShare:
    """One rank's answer: the checksums of what it sent, or why it could not."""

    rank: int
    num_bytes: int
    checksums: dict[int, dict[str, str]] | None  # decode rank -> region -> sum (decode ranks written only)
    error: str | None = None


@dataclass
class _Peer:
    """One decode engine as this rank sees it: per decode rank a control client and a backend peer."""

    clients: list[DecodeControlClient]
    keys: list[str]
    mapping: TPMapping

    @property
    def leader(self) -> DecodeControlClient:
        """Decode rank 0: reservations, TransferReady, aborts."""
        return self.clients[0]


class RankSender:
    def __init__(
        self, backend: TransferBackend, cache: ModelCache, layout: CacheLayout, compat_hash: str,
        timeout_s: float = 30.0, *, control_auth: ControlAuth,
    ) -> None:
        """`control_auth`: the deployment's secret (and mTLS files), which every decode rank's control server wants
        (transfer/auth.py)."""
        self.backend, self.cache, self.layout = backend, cache, layout
        self.control_secret, self.control_tls = control_auth.secret, control_auth.tls()
        self.regions = register_cache(backend, cache)
        self.compat_hash = compat_hash
        self.timeout_s = timeout_s
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()

    def peer(self, addresses: Addresses, request_id: str = "") -> _Peer:
        """Handshake once per decode engine, with each of its ranks: agent metadata, regions,
        layout, compatibility. `addresses[r]` must answer as rank r of len(addresses); `request_id`
        names the reservation about to be written (decode rank 0 shows its regions for a live one only)."""
        addresses = tuple(addresses)
        with self._lock:
            peer = self._peers.get(addresses)
            if peer is None:
                peer = self._peers[addresses] = self._handshake(addresses, request_id)
            return peer

    def _handshake(self, addresses: Addresses, request_id: str) -> _Peer:
        if not addresses:
            raise ValueError("a decode engine needs at least one control address")
        clients: list[DecodeControlClient] = []
        try:
            infos = []
            for r, address in enumerate(addresses):
                clients.append(DecodeControlClient(address, self.compat_hash, secret=self.control_secret,
                                                   tls=self.control_tls))
                info = clients[-1].handshake(self.backend.agent_info(), self.layout.to_json(), self.layout.tp_size,
                                             self.layout.tp_rank, request_id)
                if (info.tp_rank, info.tp_size) != (r, len(addresses)):
                    raise TransferError(
                        f"decode address {address} (position {r} of {len(addresses)}) answered as rank {info.tp_rank} "
                        f"of a TP-{info.tp_size} engine: a handoff target must list every decode rank's address, "
                        "in rank order")
                infos.append(info)
            decode = [RankCache(CacheLayout.from_json(i.layout_json), {x.name: x for x in i.agent.regions}) for i in infos]
            mapping = TPMapping([RankCache(self.layout, self.regions)], decode)
            return _Peer(clients, [self.backend.connect(i.agent) for i in infos], mapping)
        except BaseException:
            for client in clients:
                client.close()
            raise

    def forget(self, addresses: Addresses) -> None:
        """Drop a peer (it restarted or failed): the next job handshakes again."""
        with self._lock:
            peer = self._peers.pop(tuple(addresses), None)
        if peer is not None:
            for client in peer.clients:
                client.close()

    def push(self, job: HandoffJob) -> RankShare:
        """Write this rank's share of `job` into every decode rank it feeds and wait until all of
        it has landed. Never raises: a failure is reported in the share, so every rank still
        joins the gather that follows."""
        try:
            peer = self.peer(job.decode_addresses, job.request_id)
            span = RequestSpan(job.src_block_ids, job.reservation.block_ids, job.src_slot, job.reservation.slot_id,
                               job.num_tokens, peer.mapping.dcp_size)
            s = self.layout.tp_rank
            ops = peer.mapping.ops(span)
            batches = [(peer.keys[r], ops[(s, r)]) for r in range(peer.mapping.decode_tp) if ops.get((s, r))]
            sums = self._write_and_wait(batches, lambda: self._checksums(job, peer.mapping))
            return RankShare(s, sum(op.length for _, batch in batches for op in batch), sums)
        except Exception as e:
            self.forget(job.decode_addresses)
            return RankShare(self.layout.tp_rank, 0, None, f"{type(e).__name__}: {e}")

    def _checksums(self, job: HandoffJob, mapping: TPMapping) -> dict[int, dict[str, str]]:
        """The sums of this rank's share of every decode rank's view it feeds, from its own cache, in one pass."""
        views = {r: (view.heads, view.mla) for r in range(mapping.decode_tp)
                 if (view := mapping.view(self.layout.tp_rank, r)) is not None}
        request = CachedRequest(self.cache, self.layout, job.src_block_ids, job.src_slot, job.num_tokens)
        return views_checksums(request, views, mapping.dcp_size)

    def _write_and_wait(self, batches: list[tuple[str, list]], meanwhile: Callable[[], T] | None = None) -> T | None:
        """Post one batch per decode rank, run `meanwhile` (if given) while they are in flight, then
        wait for all of them; returns what `meanwhile` returned."""
        handles = []
        try:
            for peer_key, ops in batches:
                handles.append(self.backend.write(peer_key, ops))
            result = meanwhile() if meanwhile is not None else None
            deadline = time.monotonic() + self.timeout_s
            pending = list(handles)
            while pending:
                status = self.backend.poll(pending[0])
                if status is TransferStatus.FAILED:
                    raise TransferError("the backend reported a write batch as failed")
                if status is TransferStatus.DONE:
                    pending.pop(0)
                    continue
                if time.monotonic() > deadline:
                    # Memory under a write that may still land must stay pinned: the caller's
                    # lease (not this timeout) decides when it is released.
                    raise TransferError(f"writes did not land within {self.timeout_s} s")
                time.sleep(0.0001)
            return result
        finally:
            for handle in handles:
                self.backend.release(handle)

    def close(self) -> None:
        for addresses in list(self._peers):
            self.forget(addresses)
        self.backend.close()
