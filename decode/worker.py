"""Decode worker: reserves room for a request, receives its prompt state, continues from its first token.

The ingress admits a request (a reservation of blocks and one KDA slot, under a lease); prefill ranks write its
state into every decode rank and report with TransferReady; once all have, rank 0 verifies the landed bytes'
checksums on every rank and adopts the request (or fails it loudly and frees the reservation). It drives its
engine through the handoff seam (`KVHandoff`); every pool operation runs on the engine thread, so the scheduler
never races a gRPC handler. A reservation never completed is freed when its lease runs out, on abort, or when
its stream is abandoned. Control-plane reservations are bounded per peer host (`max_reservations_per_peer`), their
size by `max_model_len`, their lease by `lease_seconds`. Landed state is checked again right before the request's
first decode step, and its prompt's MLA rows (which decoding never rewrites) at random steps with
`reverify_probability`: state changed behind the engine's back (a stray or hostile one-sided write) fails the
request with an error, counted (`k3serve:transfer_integrity_failures_total`) and logged, never continued. A router
follows its requests through one feed (`feed`, then `admit(..., feed=...)`): per engine step one message with the
deltas of all of them. Ranks > 0 run `decode.rank.follower_main`; the
engine's address is its ranks' control addresses, rank 0 first. The sequence is drawn in docs/design/handoff.md.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from k3serve.decode.errors import UnknownFeedError
from k3serve.decode.handoff import make_receiver
from k3serve.engine.config import EngineArgs
from k3serve.engine.kv_handoff import BoundaryState, DeltaFeed, EngineStats, Item, KVHandoff, TPGroup
from k3serve.engine.outputs import RequestDelta
from k3serve.engine.sampling_params import SamplingParams
from k3serve.transfer.auth import ControlAuth, process_auth
from k3serve.transfer.backend import AgentInfo
from k3serve.transfer.checksum import combine_request_checksums, mismatched_regions, split_rank_checksums
from k3serve.transfer.control import (
    ChecksumMismatchError,
    DecodeControlServer,
    HandshakeInfo,
    InvalidArgumentError,
    NoCapacityError,
    Reservation,
    UnknownRequestError,
)
from k3serve.transfer.metrics import transfer_metrics
from k3serve.transfer.tp_map import sending_ranks

logger = logging.getLogger(__name__)


class HandoffFailedError(RuntimeError):
    """A request's state did not arrive intact or in time; it is failed, never continued."""


@dataclass
class _Pending:
    """A reservation waiting for its handoff."""

    state: BoundaryState  # where the handoff lands
    deadline: float  # monotonic
    attempt: int  # the reservation's handoff attempt: TransferReady must name it
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None
    shares: dict[int, dict[int, dict[str, str]]] = field(default_factory=dict)  # prefill rank -> decode rank -> sums
    first_token_id: int | None = None
    grammar: Any = None  # the structured output constraint's compiled grammar, for the adoption
    peer: str | None = None  # the control-plane peer host that reserved it; None: admitted by the router


@dataclass
class _Landed:
    """An adopted request's verified state, to check again: before its first decode step, then at random steps."""

    state: BoundaryState
    num_tokens: int  # the prompt's, whose state landed
    sums: list[dict[str, str]]  # [decode_tp] region -> checksum, as verified at adoption
    stepped: bool = False  # its first decode step ran (its KDA slot moves on from now: only MLA rows are checked)


class DecodeWorker:
    def __init__(
        self,
        args: EngineArgs,
        transfer: str = "local",
        prefill_tp: int = 1,
        lease_seconds: float = 30.0,
        verify_checksums: bool = True,
        host: str = "127.0.0.1",
        transfer_options: dict | None = None,
        name: str = "decode-0",
        group: TPGroup | None = None,
        control_auth: ControlAuth | None = None,
        max_reservations_per_peer: int = 16,
        reverify_probability: float = 0.0,
    ) -> None:
        """`control_auth`: the deployment's secret and mTLS files (transfer/auth.py; default this process's own).
        `lease_seconds`: a reservation's lease, and the longest a control-plane Reserve may ask for.
        `reverify_probability`: the chance per step that an adopted request's prompt MLA rows are checked again (0:
        only before its first step)."""
        if max_reservations_per_peer < 1:
            raise ValueError(f"max_reservations_per_peer must be >= 1, got {max_reservations_per_peer}")
        if not 0.0 <= reverify_probability <= 1.0:
            raise ValueError(f"reverify_probability must be in [0, 1], got {reverify_probability}")
        self.name = name
        self.handoff = KVHandoff(args, group, on_abort=self._on_engine_abort, before_step=self._check_adopted)
        self.decode_tp = self.handoff.tp_size
        self.lease_seconds = lease_seconds
        self.verify_checksums = verify_checksums
        self.max_reservations_per_peer = max_reservations_per_peer
        self.reverify_probability = reverify_probability
        self._adopted: dict[str, _Landed] = {}  # engine thread
        self._random = random.Random()
        self.prefill_tp = prefill_tp
        self.metrics = transfer_metrics().bind(model=self.handoff.model_name, role="decode")
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._streams: dict[str, AsyncIterator[RequestDelta]] = {}  # admitted, not yet followed
        self._admitting: dict[str, bool] = {}  # request id -> aborted while `admit` awaited; the event loop's
        self._feeds: dict[str, DeltaFeed] = {}  # open feeds by id
        self._num_attempts = 0  # reservations handed out so far: the last one's attempt number
        self.receiver = self.server = None
        try:
            self._expected_ranks = self._sources(prefill_tp)
            self.receiver = make_receiver(self.handoff.cache_view, transfer, transfer_options, prefill_tp)
            self.compat_hash = self.receiver.compat_hash
            auth = control_auth or process_auth()
            self.server = DecodeControlServer(self, self.compat_hash, host=host, secret=auth.secret,
                                              tls=auth.tls()).start()
            self.control_addresses: tuple[str, ...] = self.handoff.submit(self._gather_addresses).result()
        except BaseException:
            self.shutdown()  # releases the followers too: none is left waiting for rank 0
            raise

    @property
    def control_address(self) -> str:
        """Rank 0's control address (reservations, TransferReady): the whole engine when TP is 1."""
        return self.server.address

    async def address(self) -> str:
        return self.server.address

    async def addresses(self) -> tuple[str, ...]:
        """Every rank's control address, rank order: what a `HandoffTarget` names."""
        return self.control_addresses

    def _gather_addresses(self) -> tuple[str, ...]:
        """Engine thread, once: each rank's control server address (followers started theirs)."""
        return tuple(self.handoff.on_all_ranks("addresses", (), lambda: self.server.address))

    def _sources(self, prefill_tp: int) -> set[int]:
        """Prefill ranks that write into some rank of this decode engine, for a prefill pool of TP P."""
        heads = self.handoff.num_kda_heads
        for what, tp in (("prefill", prefill_tp), ("decode", self.decode_tp)):
            if heads % tp:
                raise ValueError(f"{what} TP {tp} does not divide the model's {heads} KDA heads")
        return sending_ranks(prefill_tp, self.decode_tp, heads)

    # ---- ingress side -------------------------------------------------------------------------
    async def admit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, feed: str | None = None
    ) -> Reservation:
        """Reserve room for a request the ingress routes here; raises NoCapacityError if full.
        Its deltas go to the open feed `feed`, else to `stream(request_id)`; either is set up
        now, so nothing the handoff produces can be missed. A structured output constraint is
        compiled first, off the engine thread (its steps go on), and kept for the adoption: one this
        engine cannot serve (it does not compile, or no xgrammar here) is a ValueError, before
        anything is reserved or the prompt runs anywhere. An abort while this awaits leaves nothing."""
        if request_id in self._admitting:
            raise InvalidArgumentError(f"request {request_id!r} is already being admitted here")
        self._admitting[request_id] = False
        try:
            grammar = await self.handoff.grammar(params.structured_outputs)
            reservation = await self.handoff.call(lambda: self._reserve(request_id, len(prompt_token_ids)))
        finally:
            aborted = self._admitting.pop(request_id)
        if aborted:  # `abort_request` found nothing to free yet: the reservation goes now
            await self.handoff.abort(request_id)
            raise UnknownRequestError(f"request {request_id!r} was aborted during its admission")
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is not None:
                pending.prompt_token_ids, pending.params, pending.grammar = list(prompt_token_ids), params, grammar
        if feed is None:
            self._streams[request_id] = self.handoff.stream(request_id)
        elif feed in self._feeds:  # checked after the await: the feed may have ended meanwhile
            self.handoff.follow(request_id, self._feeds[feed])
        else:
            await self.handoff.abort(request_id)  # frees the reservation
            raise UnknownFeedError(f"decode worker {self.name} serves no feed {feed!r}")
        return reservation

    async def stream(self, request_id: str) -> AsyncIterator[RequestDelta]:
        """The deltas of a request admitted without a feed, from its first token to the end."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            raise UnknownRequestError(f"request {request_id!r} was not admitted here (or is already streamed)")
        async for delta in stream:
            yield delta

    async def feed(self, feed_id: str) -> AsyncIterator[list[tuple[str, Item]]]:
        """Open feed `feed_id`: first an empty batch (the feed is open: admit may name it), then per
        engine step the (request_id, delta or error) of every request admitted through it. When
        the consumer stops, the requests it still carries are aborted."""
        if feed_id in self._feeds:
            raise ValueError(f"feed {feed_id!r} is already open")
        feed = self._feeds[feed_id] = DeltaFeed()
        try:
            yield []
            async for batch in feed.batches():
                yield batch
        finally:
            del self._feeds[feed_id]
            for request_id in list(feed.request_ids):
                await self.handoff.abort(request_id)

    async def abort_request(self, request_id: str) -> None:
        if request_id in self._admitting:
            self._admitting[request_id] = True
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            await stream.aclose()
        await self.handoff.abort(request_id)

    async def stats(self) -> EngineStats:
        self._expire_leases()
        return await self.handoff.call(lambda: self.handoff.stats(num_reserved=len(self._pending)))

    async def metrics_text(self) -> str:
        """This process's k3serve metrics (transfer counters, pins), for the ingress to re-export."""
        from k3serve.cluster.replica_metrics import render_worker_metrics

        return render_worker_metrics()

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop(grace=1.0)
        self.handoff.shutdown()  # stops the followers too
        if self.receiver is not None:
            self.receiver.close()

    # ---- DecodeControlHandler (gRPC threads) ---------------------------------------------------
    def handshake(self, peer: AgentInfo, layout_json: str, tp_size: int, tp_rank: int,
                  request_id: str) -> HandshakeInfo:
        """Rank 0's regions go to a peer about to write a live reservation only (one it was granted)."""
        now = time.monotonic()
        with self._lock:
            pending = self._pending.get(request_id)
            live = pending is not None and pending.deadline >= now
        if not live:
            raise UnknownRequestError("handshake names no live reservation on this decode engine: a peer learns "
                                      "its regions only to write a reservation it was granted")
        return self.receiver.handshake(peer, layout_json, tp_size, tp_rank)

    def reserve(self, request_id: str, num_tokens: int, lease_seconds: float, peer: str) -> Reservation:
        if num_tokens > self.handoff.max_model_len:
            raise InvalidArgumentError(f"num_tokens {num_tokens} exceeds this engine's max_model_len "
                                       f"{self.handoff.max_model_len}")
        if lease_seconds > self.lease_seconds:
            raise InvalidArgumentError(f"lease_seconds {lease_seconds:g} exceeds this decode's limit "
                                       f"{self.lease_seconds:g} (heartbeats extend a lease)")
        return self.handoff.submit(lambda: self._reserve(request_id, num_tokens, lease_seconds, peer)).result()

    def transfer_ready(
        self, request_id: str, from_rank: int, first_token_id: int, num_tokens: int, checksums: dict[str, str],
        attempt: int,
    ) -> None:
        """A prefill rank's writes into reservation `attempt` of `request_id` landed. Only the request's live
        reservation is completed: a report for an attempt since dropped (a retry that replaced it, a stale
        prefill replica) is refused and changes nothing."""
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is None or pending.attempt != attempt:
                raise UnknownRequestError(f"request {request_id!r} holds no reservation of attempt {attempt} here "
                                          "(aborted, expired or replaced by a retry)")
            if from_rank not in self._expected_ranks:
                raise InvalidArgumentError(f"rank {from_rank} does not write into this decode engine")
            try:
                pending.shares[from_rank] = split_rank_checksums(checksums, self.decode_tp)
            except ValueError as e:
                raise InvalidArgumentError(f"request {request_id!r}, prefill rank {from_rank}: {e}") from None
            pending.first_token_id = first_token_id
            complete = set(pending.shares) == self._expected_ranks
        if not complete:
            return
        if pending.params is None or len(pending.prompt_token_ids or ()) != num_tokens:
            self._fail(request_id, HandoffFailedError(f"handoff of {request_id!r} does not match what was admitted"))
            raise InvalidArgumentError(f"request {request_id!r}: {num_tokens} tokens, admitted {pending.prompt_token_ids!r:.40}")
        self.handoff.submit(lambda: self._adopt(request_id, pending)).result()

    def abort(self, request_id: str, reason: str) -> None:
        self.handoff.submit(lambda: self._drop_reservation(request_id, HandoffFailedError(reason))).result()

    def heartbeat(self, request_ids: list[str], sender: str) -> list[str]:
        now = time.monotonic()
        unknown = []
        with self._lock:
            for rid in request_ids:
                pending = self._pending.get(rid)
                if pending is None:
                    unknown.append(rid)
                else:
                    pending.deadline = max(pending.deadline, now + self.lease_seconds)
        self._expire_leases()
        return unknown

    # ---- engine thread ---------------------------------------------------------------------------
    def _reserve(self, request_id: str, num_tokens: int, lease_seconds: float | None = None,
                 peer: str | None = None) -> Reservation:
        now = time.monotonic()
        with self._lock:
            if request_id in self._pending or self.handoff.has_request(request_id):
                raise InvalidArgumentError(f"request {request_id!r} is already here")
            held = 0 if peer is None else sum(p.peer == peer and p.deadline >= now for p in self._pending.values())
        if held >= self.max_reservations_per_peer:
            raise NoCapacityError(f"peer {peer} already holds {held} reservations here, the limit "
                                  f"max_reservations_per_peer={self.max_reservations_per_peer}")
        state = self.handoff.reserve(request_id, num_tokens)
        if state is None:
            free = self.handoff.stats()
            raise NoCapacityError(f"no capacity for {num_tokens} tokens: {free.num_free_blocks} free blocks, "
                                  f"{free.num_free_slots} free slots")
        lease = lease_seconds or self.lease_seconds
        with self._lock:
            self._num_attempts += 1
            attempt = self._num_attempts
            self._pending[request_id] = _Pending(state, time.monotonic() + lease, attempt, peer=peer)
        return Reservation(state.block_ids, state.slot_id, time.time() + lease, attempt)

    def _adopt(self, request_id: str, pending: _Pending) -> None:
        with self._lock:
            if self._pending.pop(request_id, None) is None:
                raise UnknownRequestError(f"request {request_id!r} was aborted during its handoff")
        state = pending.state
        landed: list[dict[str, str]] | None = None
        if self.verify_checksums:
            bad, landed = self._verify(state, len(pending.prompt_token_ids), pending.shares)
            if bad:
                self.handoff.cancel(state)
                error = ChecksumMismatchError(f"request {request_id!r}: state corrupted in transfer, regions {bad}")
                self.handoff.fail(request_id, HandoffFailedError(str(error)))
                raise error
        try:
            self.handoff.adopt(state, pending.prompt_token_ids, pending.first_token_id, pending.params,
                               pending.grammar)
        except ValueError as error:  # refused before it took the reservation: free it, end the stream
            self.handoff.cancel(state)
            self.handoff.fail(request_id, error)
            raise
        if landed is not None:
            self._adopted[request_id] = _Landed(state, len(pending.prompt_token_ids), landed)

    def _landed(self, state: BoundaryState, num_tokens: int) -> list[dict[str, str] | str]:
        """Engine thread: every decode rank's checksums of its view of `state`'s first `num_tokens` tokens (one
        gather through the TP group), or why a rank could not compute them."""
        args = (state.block_ids, state.slot_id, num_tokens)
        return self.handoff.on_all_ranks("checksums", args, lambda: self.receiver.landed_checksums(*args))

    def _verify(self, state: BoundaryState, num_tokens: int, shares: dict[int, dict[int, dict[str, str]]]
                ) -> tuple[list[str], list[dict[str, str]]]:
        """Engine thread: every decode rank checksums its landed shard; each is compared with the sum of what the
        prefill ranks sent it. Returns the mismatched "<decode rank>/<region>" names (or why a rank could not
        tell; [] = intact) and the landed sums by rank."""
        landed = self._landed(state, num_tokens)
        bad = []
        for r, got in enumerate(landed):
            if not isinstance(got, dict):
                bad.append(str(got))
                continue
            expected = combine_request_checksums(share.get(r, {}) for share in shares.values())
            bad += [f"{r}/{name}" for name in mismatched_regions(expected, got, self.metrics)]
        return bad, [got for got in landed if isinstance(got, dict)]

    def _check_adopted(self) -> dict[str, str]:
        """Engine thread, before each step schedules (`before_step`): the adopted requests whose state changed
        since it was verified, with why; each is counted and logged here, and failed by the engine."""
        failed: dict[str, str] = {}
        for request_id in [rid for rid in self._adopted if not self.handoff.has_request(rid)]:
            del self._adopted[request_id]  # finished or aborted
        for request_id, landed in list(self._adopted.items()):
            if landed.stepped and self._random.random() >= self.reverify_probability:
                continue
            stage = "step" if landed.stepped else "first_step"
            bad = self._changed_regions(landed)
            landed.stepped = True
            if bad:
                self.metrics.integrity_failure(stage)
                logger.error("decode %s: request %r: state changed after its handoff was verified (%s check), "
                             "regions %s: failing it", self.name, request_id, stage, bad)
                failed[request_id] = (f"request {request_id!r}: its cached state changed after the handoff was "
                                      f"verified (regions {bad}); failed rather than continued")
            if bad or self.reverify_probability == 0.0:
                del self._adopted[request_id]
        return failed

    def _changed_regions(self, landed: _Landed) -> list[str]:
        """"<rank>/<region>" of `landed` whose sums differ from those verified: every region before the first
        decode step, the MLA ones after it (the KDA slot moves with each step; the prompt's MLA rows never do)."""
        bad = []
        for r, (got, verified) in enumerate(zip(self._landed(landed.state, landed.num_tokens), landed.sums)):
            if not isinstance(got, dict):
                bad.append(str(got))
                continue
            names = [n for n in verified if not landed.stepped or n.startswith("mla.")]
            bad += [f"{r}/{name}" for name in names if got.get(name) != verified[name]]
        return bad

    def _drop_reservation(self, request_id: str, error: BaseException) -> bool:
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is None:
            return False
        self.handoff.cancel(pending.state)
        self.handoff.fail(request_id, error)
        return True

    def _on_engine_abort(self, request_id: str) -> None:
        """Engine thread, after any abort (incl. an abandoned stream): free a pending reservation."""
        self._drop_reservation(request_id, HandoffFailedError("aborted"))

    def _fail(self, request_id: str, error: BaseException) -> None:
        self.handoff.submit(lambda: self._drop_reservation(request_id, error))

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, p in self._pending.items() if p.deadline < now]
        for rid in expired:
            self.metrics.lease_expired()
            self._fail(rid, HandoffFailedError(f"request {rid!r}: no handoff within its lease"))

    @property
    def backend(self):
        """Rank 0's transfer agent."""
        return self.receiver.backend
