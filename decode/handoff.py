"""One decode rank's part of a handoff: its transfer agent over its cache shard, its answer to a
prefill rank's handshake, and the checksums of what landed in its shard.

Every decode rank owns a `RankReceiver` and serves `DecodeControl` on its own address, so each prefill rank
writes straight into its shard. Rank 0 (`DecodeWorker`) answers everything; ranks > 0 only answer handshakes
(`HandshakeOnly`). Drawn: docs/design/handoff.md §3.
"""

from __future__ import annotations

from collections.abc import Sequence

from k3serve.engine.kv_handoff import CacheView
from k3serve.model.batch import ModelCache
from k3serve.transfer.backend import AgentInfo, TransferBackend
from k3serve.transfer.backends import make_backend
from k3serve.transfer.checksum import CachedRequest, request_checksums
from k3serve.transfer.control import HandshakeInfo, InvalidArgumentError, Reservation
from k3serve.transfer.layout import CacheLayout, HeadSlice, register_cache
from k3serve.transfer.tp_map import RankCache, TPMapping


def make_receiver(view: CacheView, transfer: str, transfer_options: dict | None, prefill_tp: int) -> RankReceiver:
    """This decode rank's transfer agent over its cache shard."""
    layout = CacheLayout.from_view(view)
    backend = make_backend(transfer, **(transfer_options or {}))
    return RankReceiver(backend, view.cache, layout, layout.compat_hash, prefill_tp)


class RankReceiver:
    def __init__(
        self, backend: TransferBackend, cache: ModelCache, layout: CacheLayout, compat_hash: str, prefill_tp: int
    ) -> None:
        self.backend, self.cache, self.layout = backend, cache, layout
        self.regions = register_cache(backend, cache)
        self.compat_hash = compat_hash
        self.prefill_tp = prefill_tp

    @property
    def rank(self) -> int:
        return self.layout.tp_rank

    def handshake(self, peer: AgentInfo, layout_json: str, tp_size: int, tp_rank: int) -> HandshakeInfo:
        """Check a prefill rank against this rank's shard; answer with this rank's agent and layout."""
        if tp_size != self.prefill_tp:
            raise InvalidArgumentError(f"this decode pool expects prefill TP {self.prefill_tp}, peer has {tp_size}")
        peer_layout = CacheLayout.from_json(layout_json)
        try:  # what TPMapping checks: compat hash, layer structure, regions vs layout, TP sizes
            TPMapping([RankCache(peer_layout, {r.name: r for r in peer.regions})], [RankCache(self.layout, self.regions)])
        except ValueError as e:
            raise InvalidArgumentError(f"prefill rank {tp_rank} cannot write into decode rank {self.rank}: {e}") from None
        return HandshakeInfo(self.backend.agent_info(), self.layout.to_json(), self.layout.tp_size, self.layout.tp_rank)

    def landed_checksums(self, block_ids: Sequence[int], slot_id: int, num_tokens: int) -> dict[str, str] | str:
        """Region sums of this rank's whole view of a request, or why they could not be computed
        (a string, so a follower still answers the gather instead of leaving rank 0 waiting)."""
        try:
            request = CachedRequest(self.cache, self.layout, block_ids, slot_id, num_tokens).dcp_pages(
                self.layout.dcp_size, self.layout.dcp_rank, whole_blocks=False)
            return request_checksums(request, HeadSlice.whole_shard(self.layout))
        except Exception as e:
            return f"rank {self.rank} could not checksum its shard: {type(e).__name__}: {e}"

    def close(self) -> None:
        self.backend.close()


class HandshakeOnly:
    """The `DecodeControlHandler` of a decode rank > 0: handshakes only; rank 0 owns requests."""

    def __init__(self, receiver: RankReceiver) -> None:
        self.receiver = receiver

    def handshake(self, peer: AgentInfo, layout_json: str, tp_size: int, tp_rank: int,
                  request_id: str) -> HandshakeInfo:
        """Any authenticated peer: a rank > 0 does not know the reservations (rank 0 does)."""
        return self.receiver.handshake(peer, layout_json, tp_size, tp_rank)

    def _refuse(self, *args: object) -> None:
        raise InvalidArgumentError(f"rank {self.receiver.rank} of a decode engine only answers handshakes "
                                   "(reservations, TransferReady, aborts and heartbeats go to rank 0)")

    def reserve(self, request_id: str, num_tokens: int, lease_seconds: float, peer: str) -> Reservation:
        self._refuse()

    def transfer_ready(self, request_id: str, from_rank: int, first_token_id: int, num_tokens: int,
                       checksums: dict[str, str], attempt: int) -> None:
        self._refuse()

    def abort(self, request_id: str, reason: str) -> None:
        self._refuse()

    def heartbeat(self, request_ids: list[str], sender: str) -> list[str]:
        self._refuse()
