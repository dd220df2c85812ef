"""The disaggregated backend of the ingress: an `EngineClient` over prefill and decode pools.

One request: (1) checked as the engines check it (`engine/prompt_check.py`, its structured output constraint
parsed), then admitted on the decode replica with the fewest requests in flight from here (then the most free
blocks), the next one on NoCapacity, or queued (`cluster/admission.py`) while all are full; (2) a prefill
replica picked by the prefix unit it holds against its load (`cluster/prefix_routing.py`) pushes the prompt state into the reservation; if it fails, the
attempt is dropped on decode and retried once, on another prefill replica if there is one, into a new
reservation (a live decode replica first); (3) its deltas streamed from the decode replica's feed
(`cluster/decode_feed.py`); a feed that dies mid-stream is migrated: the request continues on another decode
replica (`cluster/migration.py`). Client gone or any failure: abort on both sides. Replica stats
are refreshed in the background for routing and the pool gauges. A replica whose refresh fails has its series
dropped and is marked stale at once; /health is 503 while a pool has no replica answering, or while every decode
replica's room is held by reservations that do not move (`cluster/room_watch.py`). The replica lists change
while serving: the autoscaler (`cluster/autoscaler.py`) adds replicas and drains them (routed nothing new,
waited for, then removed). The steps in full: docs/design/router.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import logging
from typing import AsyncIterator, Iterator, Sequence

from k3serve.cluster.admission import AdmissionQueue
from k3serve.cluster.decode_feed import DecodeFeed, RequestDeltas
from k3serve.cluster.errors import PoolDegradedError, ReplicaDiedError, ReplicaUnavailableError
from k3serve.cluster.metrics import IngressMetrics
from k3serve.cluster.migration import MAX_MIGRATIONS, Continuation, refusal
from k3serve.cluster.prefix_routing import PrefixRouting
from k3serve.cluster.replica_metrics import ReplicaMetricsCollector
from k3serve.cluster.replicas import DecodeReplica, PrefillReplica
from k3serve.cluster.room_watch import STALL_SECONDS, RoomWatch
from k3serve.decode.errors import UnknownFeedError
from k3serve.engine.constraint import parse_constraint
from k3serve.engine.outputs import RequestDelta
from k3serve.engine.prompt_check import check_prompt
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.tokenizer import Tokenizer
from k3serve.prefill.messages import HandoffTarget, PrefillResult
from k3serve.transfer.control import NoCapacityError

log = logging.getLogger(__name__)

AFFINITY_TOKENS = 256  # prompts that share their first tokens go to the same prefill replica
AFFINITY_SLACK = 2  # ... unless it has this many more requests in flight than the least loaded
CLEANUP_SECONDS = 5.0  # an abort on a replica that may be dead or restarting waits no longer


class DisaggregatedRouter:
    def __init__(
        self,
        prefill: Sequence[PrefillReplica],
        decode: Sequence[DecodeReplica],
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        metrics: IngressMetrics | None = None,
        refresh_seconds: float = 0.25,
        max_queued_requests: int | None = None,
        queue_timeout_seconds: float | None = None,
        admission_stall_seconds: float = STALL_SECONDS,
        migrate_on_decode_failure: bool = True,
        block_size: int = 64,
        shared_prefix_store: bool = False,
    ) -> None:
        """vocab_size: the model's (config.json), which the engines check ids against.
        max_queued_requests / queue_timeout_seconds bound the admission queue (None: no bound,
        as the colocated engine's scheduler queues); admission_stall_seconds: how long a decode
        replica's room may stay held by unmoving reservations before it counts as unable to admit
        (`cluster/room_watch.py`); migrate_on_decode_failure: continue a stream whose decode replica died
        on another one; block_size / shared_prefix_store: the engines' block size and whether the prefill pool
        offloads prefix units to a store every replica reads (`cluster/prefix_routing.py`); `k3serve serve`
        passes ServeConfig's."""
        self.prefill, self.decode = list(prefill), list(decode)
        self.tokenizer, self.model_name, self.max_model_len = tokenizer, model_name, max_model_len
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.replica_metrics = ReplicaMetricsCollector(metrics.registry if metrics is not None else None)
        self.refresh_seconds = refresh_seconds
        self.migrate_on_decode_failure = migrate_on_decode_failure
        self._decode_stats: dict[str, object] = {}
        self._inflight: dict[str, int] = {r.name: 0 for r in self.prefill}  # prefill requests in flight
        self._decoding: dict[str, int] = {r.name: 0 for r in self.decode}  # admitted here, not yet ended
        self._healthy: dict[str, bool] = {}  # answered its last stats call
        self._room = RoomWatch(admission_stall_seconds)
        self._feeds: dict[str, DecodeFeed] = {r.name: DecodeFeed(r) for r in self.decode}
        self._prompt_tokens: dict[str, int] = {r.name: 0 for r in self.prefill}  # of the prefills in flight
        self._prefixes = PrefixRouting(block_size, shared_prefix_store)  # which prefill replica holds which units
        self._draining: set[str] = set()  # chosen for removal: routed nothing new (`drain`)
        self._refresher: asyncio.Task | None = None
        self.admission: AdmissionQueue[tuple[DecodeReplica, HandoffTarget, RequestDeltas]] = AdmissionQueue(
            max_queued_requests, queue_timeout_seconds, metrics.set_ingress_queue if metrics is not None else None,
            metrics.observe_queue_time if metrics is not None else None)
        if metrics is not None:
            metrics.set_ingress_queue(0)

    # ---- EngineClient ---------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Healthy once every pool has at least one replica answering, and a decode replica that
        can admit work; otherwise ReplicaUnavailableError, saying which (`PoolDegradedError` when
        the decode replicas answer but every one is stalled)."""
        await self._refresh()
        for pool, replicas in (("prefill", self.prefill), ("decode", self.decode)):
            if not any(self._healthy.get(r.name) for r in replicas):
                raise ReplicaUnavailableError(f"no healthy {pool} replica")
        stalls = [self._room.stall(r.name) for r in self.decode if self._healthy.get(r.name)]
        if all(stalls):
            raise PoolDegradedError(f"degraded: no decode replica can admit a request: {'; '.join(stalls)}")

    async def abort(self, request_id: str) -> None:
        """The stream's own cleanup aborts on both sides; nothing is left to do by id."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """The request's deltas. A decode replica that dies mid-stream is replaced: the request continues
        on another one from the tokens sent (`cluster/migration.py`) unless migration is off or cannot be
        exact for it; then the replica's ReplicaDiedError ends the stream."""
        self._start_refresher()
        prompt = request.prompt
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid, params = request.request_id, request.sampling_params
        check_prompt(prompt_ids, params, self.vocab_size, self.max_model_len)
        if params.structured_outputs is not None:
            parse_constraint(params.structured_outputs)
        sent: list[int] = []  # token ids the client has
        lost: set[str] = set()  # decode replicas this request's streams died on
        continuation: Continuation | None = None
        num_migrations = 0
        attempt_ids = _attempt_ids(rid)
        while True:
            leg_prompt, leg_params = (prompt_ids, params) if continuation is None else (
                continuation.prompt_token_ids, continuation.params)
            try:  # closed here, not when collected: a client that leaves frees its room before aclose() returns
                async with contextlib.aclosing(self._leg(rid, leg_prompt, leg_params, lost, attempt_ids)) as leg:
                    async for delta in leg:
                        if continuation is not None:
                            delta = continuation.delta(delta)
                        sent += delta.new_token_ids
                        yield delta
                return
            except ReplicaDiedError as died:
                why = self._why_not_migrate(params, sent, num_migrations)
                if why is not None:
                    log.info("request %s not migrated: %s", rid, why)
                    raise
                log.warning("request %s: %s; continuing on another decode replica after %d tokens", rid, died,
                            len(sent))
                if self.metrics is not None:
                    self.metrics.count_migration()
                num_migrations += 1
                continuation = Continuation.of(prompt_ids, params, sent)

    def _why_not_migrate(self, params, sent: list[int], num_migrations: int) -> str | None:
        if not self.migrate_on_decode_failure:
            return "migrate_on_decode_failure is off"
        if num_migrations >= MAX_MIGRATIONS:
            return f"it was migrated {num_migrations} times already"
        if params.max_tokens is not None and len(sent) >= params.max_tokens:
            return "it has all its tokens"
        return refusal(params)

    async def _leg(self, rid: str, prompt_ids: list[int], params, lost: set[str],
                   attempt_ids: Iterator[str]) -> AsyncIterator[RequestDelta]:
        """One run of a request on a decode replica: admitted (a decode replica not in `lost` first), its
        prompt handed off by a prefill replica, its deltas streamed. Each handoff attempt is its own request
        on both pools (the next of `attempt_ids`) with a reservation of its own: a failed attempt is dropped
        on decode (its reservation, or the request if decode adopted it) before the retry reserves anew, and
        decode refuses any report for a dropped attempt. A feed that dies raises ReplicaDiedError, its
        replica added to `lost`. The deltas carry `rid`."""
        what = f"request {rid} ({len(prompt_ids)} prompt tokens)"
        eid = next(attempt_ids)
        decode, target, deltas = await self.admission.admit(  # observes the queue time
            lambda: self._admit(eid, prompt_ids, params, lost), what)
        decode_done = False  # decode ended the request itself; otherwise its reservation is ours to free
        try:
            errors: list[str] = []
            result = None
            for replica in (self._prefill_order(prompt_ids) * 2)[:2]:  # one retry, elsewhere if there is one
                if not self._routable("prefill", replica):  # chosen for removal while an attempt ran
                    continue
                if errors:  # fence the failed attempt, reserve anew (a live replica first) for this one
                    avoid = lost | {decode.name}
                    failed, decode = decode, None
                    await self._drop(failed, deltas, eid)
                    if self.metrics is not None:
                        self.metrics.count_handoff_retry()
                    eid = next(attempt_ids)
                    decode, target, deltas = await self.admission.admit(
                        lambda: self._admit(eid, prompt_ids, params, avoid), what)
                try:
                    result = await self._prefill_on(replica, eid, prompt_ids, params, target)
                    break
                except (ValueError, TypeError):
                    raise
                except Exception as e:
                    log.warning("prefill replica %s failed on %s (attempt %d on %s): %r", replica.name, eid,
                                target.reservation.attempt, decode.name, e)
                    errors.append(f"{replica.name}: {type(e).__name__}")  # the client sees this; the log has the rest
            if result is None:
                raise ReplicaUnavailableError(f"prefill failed for request {rid}: {'; '.join(errors)}")
            if self.metrics is not None:
                self.metrics.observe_prefill_time(result.prefill_seconds)
                self.metrics.observe_handoff_time(result.transfer_seconds)
            if result.finished:  # ended at its first token: nothing was handed off, the reservation goes
                yield dataclasses.replace(result.delta, request_id=rid)
                return
            first_logprobs, prompt_logprobs = result.first_logprobs, result.prompt_logprobs
            try:
                async for delta in deltas:
                    delta = dataclasses.replace(delta, request_id=rid)
                    if delta.num_cached_tokens != result.num_cached_tokens:  # the prompt's cache is the prefill's
                        delta = dataclasses.replace(delta, num_cached_tokens=result.num_cached_tokens)
                    if first_logprobs is not None and delta.logprobs is None:
                        # The first token was sampled by the prefill engine; its logprobs come from there.
                        delta = dataclasses.replace(delta, logprobs=first_logprobs)  # decode's first delta: that token
                    if prompt_logprobs is not None:  # the prompt ran on the prefill engine too
                        delta = dataclasses.replace(delta, prompt_logprobs=prompt_logprobs)
                    first_logprobs = prompt_logprobs = None
                    yield delta
                    decode_done = delta.finished
            except ReplicaDiedError:
                lost.add(decode.name)
                raise
        finally:
            if decode is not None:
                self._decoding[decode.name] -= 1
                deltas.close()
                if not decode_done:
                    await _quietly(asyncio.wait_for(decode.abort_request(eid), CLEANUP_SECONDS))
            self.admission.wake()  # its room is free

    async def _drop(self, decode: DecodeReplica, deltas: RequestDeltas, rid: str) -> None:
        """End a request's handoff attempt on `decode`: its deltas unrouted, its reservation (or the
        request, if decode adopted the attempt) freed there before the next attempt reserves."""
        self._decoding[decode.name] -= 1
        deltas.close()
        await _quietly(asyncio.wait_for(decode.abort_request(rid), CLEANUP_SECONDS))
        self.admission.wake()

    # ---- routing --------------------------------------------------------------------------------
    async def _admit(self, rid: str, prompt_ids: list[int], params,
                     avoid: set[str] = frozenset()) -> tuple[DecodeReplica, HandoffTarget, RequestDeltas] | None:
        """Decode replica with the fewest requests admitted by this router and not yet ended, then
        the most free blocks; the next one on NoCapacity; None when every healthy one answered
        NoCapacity (the replicas in `avoid`, where it just failed, last): the request waits for room, which comes as requests end (a prompt shorter than
        max_model_len, as `generate` checks, fits an idle replica: every engine's cache holds a whole
        max_model_len request, engine/scheduler.py). No healthy replica: 503 at once.
        The count is live; the stats are up to `refresh_seconds` old, so ranking by free blocks
        alone sent a whole burst to one replica. The request's deltas are routed from that
        replica's feed before it is admitted there."""
        if not self._decode_stats:
            await self._refresh()
        order = sorted(
            (r for r in self.decode if self._healthy.get(r.name, True) and r.name not in self._draining),
            key=lambda r: (r.name in avoid, self._decoding[r.name],
                           -getattr(self._decode_stats.get(r.name), "num_free_blocks", 0)),
        )
        full = False  # some healthy replica answered NoCapacity
        for replica in order:
            if not self._routable("decode", replica):  # chosen for removal while an earlier one answered
                continue
            self._decoding[replica.name] += 1  # counted before the await, so concurrent admits spread
            admitted = False
            try:
                target, deltas = await self._admit_on(replica, rid, prompt_ids, params)
                admitted = True  # generate() uncounts it when the request ends
                self._room.clear(replica.name)  # it had room
                return replica, target, deltas
            except NoCapacityError:
                full = True
                continue
            except (ValueError, TypeError):
                raise
            except Exception as e:  # replica down: try the next one; the refresher marks it
                log.warning("decode replica %s failed to admit %s: %r", replica.name, rid, e)
                self._healthy[replica.name] = False
            finally:
                if not admitted:
                    self._decoding[replica.name] -= 1
        if full:
            return None
        raise ReplicaUnavailableError(f"no healthy decode replica to admit request {rid}")

    async def _admit_on(self, replica: DecodeReplica, rid: str, prompt_ids: list[int],
                        params) -> tuple[HandoffTarget, RequestDeltas]:
        """Admit on `replica`, its deltas routed from this router's feed. A replica that does not
        know the feed restarted since the feed was opened, before the feed's reader saw it end (the
        requests on that feed are gone with it): fail that feed and admit once more through a new
        one (at the restarted process's addresses); a second refusal is the caller's to handle."""
        try:
            return await self._admit_through_feed(replica, rid, prompt_ids, params)
        except UnknownFeedError:
            log.info("decode replica %s restarted: reopening its feed", replica.name)
            return await self._admit_through_feed(replica, rid, prompt_ids, params)

    async def _admit_through_feed(self, replica: DecodeReplica, rid: str, prompt_ids: list[int],
                                  params) -> tuple[HandoffTarget, RequestDeltas]:
        link = await self._feeds[replica.name].link()
        deltas = link.follow(rid)
        try:
            return HandoffTarget(link.addresses, await replica.admit(rid, prompt_ids, params, link.feed_id)), deltas
        except BaseException as e:
            deltas.close()  # not admitted: nothing comes for it
            if isinstance(e, UnknownFeedError):
                link.fail(ReplicaDiedError(f"decode replica {replica.name} restarted"))
            elif isinstance(e, asyncio.CancelledError):  # the client left; the reservation may exist
                await _quietly(replica.abort_request(rid))
            raise

    def _prefill_order(self, prompt_ids: list[int]) -> list[PrefillReplica]:
        """The replica with the longest prefix unit of the prompt, weighed against the prompt tokens it has in
        flight (`PrefixRouting.order`); among equals, rendezvous hashing on the prompt's first tokens (prefix
        affinity for a new prefix), unless that replica is loaded well above the least loaded one."""
        routable = [r for r in self.prefill if r.name not in self._draining]
        healthy = [r for r in routable if self._healthy.get(r.name, True)] or routable
        key = ",".join(map(str, prompt_ids[:AFFINITY_TOKENS])).encode()
        by_hash = sorted(healthy, key=lambda r: hashlib.sha1(key + r.name.encode()).digest())
        least = min(self._inflight[r.name] for r in healthy)
        by_load = sorted(healthy, key=lambda r: self._inflight[r.name])
        if self._inflight[by_hash[0].name] <= least + AFFINITY_SLACK:
            tie_break = [by_hash[0]] + [r for r in by_load if r is not by_hash[0]]
        else:
            tie_break = by_load
        by_name = {r.name: r for r in healthy}
        return [by_name[n] for n in self._prefixes.order([r.name for r in tie_break], prompt_ids, self._prompt_tokens)]

    async def _prefill_on(self, replica: PrefillReplica, rid: str, prompt_ids: list[int], params,
                          target: HandoffTarget) -> PrefillResult:
        """Run the prompt on `replica` into `target`; on failure abort it there (the caller retries)."""
        self._inflight[replica.name] += 1
        self._prompt_tokens[replica.name] += len(prompt_ids)
        try:
            result = await replica.prefill(rid, prompt_ids, params, target)
            self._prefixes.record(replica.name, prompt_ids)
            return result
        except (ValueError, TypeError):
            raise
        except Exception:
            await _quietly(asyncio.wait_for(replica.abort(rid), CLEANUP_SECONDS))
            raise
        finally:
            self._inflight[replica.name] -= 1
            self._prompt_tokens[replica.name] -= len(prompt_ids)

    # ---- replica list (the autoscaler's) -------------------------------------------------------
    def serving(self, pool: str) -> list:
        """`pool`'s replicas that take new requests: neither draining nor failing their stats refresh."""
        return [r for r in self._pool(pool) if r.name not in self._draining and self._healthy.get(r.name, True)]

    def load(self, pool: str, signal: str) -> float:
        """`pool`'s total `signal` (cluster/autoscaling.py SIGNALS) over its serving replicas: prompt tokens of
        the prefills in flight from here; a decode replica's running sequences (those admitted here and not
        ended, at least) or its block / slot usage as of its last stats refresh."""
        replicas = self.serving(pool)
        if signal == "queued_prompt_tokens":
            return float(sum(self._prompt_tokens[r.name] for r in replicas))
        stats = [self._decode_stats.get(r.name) for r in replicas]
        if signal == "running_sequences":
            return float(sum(max(self._decoding[r.name], getattr(s, "num_running", 0))
                             for r, s in zip(replicas, stats)))
        usage = {"kv_block_usage": "block_usage", "kda_slot_usage": "slot_usage"}[signal]
        return float(sum(getattr(s, usage, 0.0) for s in stats))

    def replicas(self, pool: str) -> list:
        """`pool`'s replicas, draining ones included."""
        return list(self._pool(pool))

    def is_draining(self, name: str) -> bool:
        return name in self._draining

    def begin_drain(self, name: str) -> None:
        """Route nothing new to replica `name` from now on (`drain` waits for what it runs)."""
        self._draining.add(name)

    def add_replica(self, pool: str, replica) -> None:
        """Route to `replica` from now on (the caller has seen it answer its stats: it is up)."""
        if pool == "prefill":
            self._inflight[replica.name] = self._prompt_tokens[replica.name] = 0
        else:
            self._decoding[replica.name] = 0
            self._feeds[replica.name] = DecodeFeed(replica)
        self._pool(pool).append(replica)
        self._healthy[replica.name] = True
        self.admission.wake()  # room for the queue

    async def drain(self, pool: str, name: str, timeout_s: float, poll_s: float = 0.05):
        """Take replica `name` out of `pool`: it is routed nothing new at once, then waited for until the requests
        it runs from here end (a prefill replica: its prefills and handoffs; a decode one: its streams), at most
        `timeout_s` (those still running then are the caller's stop to end, as a dead replica's). Returns the
        replica, no longer in the pool (its series dropped), for the caller to stop."""
        replica = next(r for r in self._pool(pool) if r.name == name)
        self.begin_drain(name)
        busy = self._inflight if pool == "prefill" else self._decoding
        deadline = asyncio.get_running_loop().time() + timeout_s
        while busy[name] and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(poll_s)
        if busy[name]:
            log.warning("%s replica %s: %d request(s) still running after the %g s drain", pool, name, busy[name],
                        timeout_s)
        self._pool(pool).remove(replica)
        self._draining.discard(name)
        if not busy[name]:  # else the requests still running uncount themselves as they end
            for counts in (self._inflight, self._prompt_tokens, self._decoding):
                counts.pop(name, None)
        self._prefixes.forget(name)
        self._healthy.pop(name, None)
        self._decode_stats.pop(name, None)
        self._room.clear(name)
        if pool == "decode":
            self._feeds.pop(name).close()
        if self.metrics is not None:
            self.metrics.remove_replica(pool, name)
            self.replica_metrics.remove(name)
        return replica

    def _routable(self, pool: str, replica) -> bool:
        """`replica` is still in `pool` and not draining."""
        return replica.name not in self._draining and replica in self._pool(pool)

    def _pool(self, pool: str) -> list:
        return {"prefill": self.prefill, "decode": self.decode}[pool]

    # ---- stats and health ---------------------------------------------------------------------
    def _start_refresher(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        """Also wakes the admission queue: room freed by other ingresses, expired leases or a
        restarted replica is noticed within `refresh_seconds`."""
        while True:
            await asyncio.sleep(self.refresh_seconds)
            await self._refresh()
            self.admission.wake()

    async def _refresh(self) -> None:
        """Every replica's stats and worker metrics. One that fails either call is unhealthy at
        once, its stats forgotten and its series dropped (marked stale): a dead replica's last
        values would read as requests still running there."""
        async def refresh(pool: str, r) -> None:
            try:
                stats = await asyncio.wait_for(r.stats(), 5.0)
                text = await asyncio.wait_for(r.metrics_text(), 5.0) if self.metrics is not None else ""
            except Exception as e:
                if r not in self._pool(pool):  # drained meanwhile: its series are gone and stay gone
                    return
                if self._healthy.get(r.name, True):
                    log.warning("%s replica %s failed its stats refresh: %r", pool, r.name, e)
                self._healthy[r.name] = False
                self._decode_stats.pop(r.name, None)
                self._room.clear(r.name)
                if self.metrics is not None:
                    self.metrics.mark_stale(pool, r.name)
                    self.metrics.set_replica_healthy(pool, r.name, False)
                    self.replica_metrics.remove(r.name)
                return
            if r not in self._pool(pool):
                return
            self._healthy[r.name] = True
            if pool == "decode":
                self._decode_stats[r.name] = stats
                self._room.observe(r.name, stats)
            if self.metrics is not None:
                self.metrics.set_replica_healthy(pool, r.name, True)
                self.metrics.set_pool_stats(
                    pool, r.name, stats.num_running, stats.num_waiting, stats.block_usage, stats.slot_usage,
                    stats.spec_mean_acceptance_length,
                )
                self.metrics.set_engine_settings(pool, r.name, stats.settings)
                self.replica_metrics.update(r.name, text)

        await asyncio.gather(*(refresh("prefill", r) for r in self.prefill), *(refresh("decode", r) for r in self.decode))
        if self.metrics is not None:
            for pool, replicas in (("prefill", self.prefill), ("decode", self.decode)):
                self.metrics.set_replicas_healthy(pool, sum(self._can_serve(r.name) for r in replicas))

    def _can_serve(self, replica: str) -> bool:
        """It answers, and (a decode replica) is not stalled."""
        return bool(self._healthy.get(replica)) and self._room.stall(replica) is None

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for feed in self._feeds.values():
            feed.close()


def _attempt_ids(rid: str) -> Iterator[str]:
    """The engine request ids of a request's handoff attempts: its own id, then `<id>#2`, `<id>#3`, ...
    (a dropped attempt's late deltas or reports can never be taken for a later attempt's)."""
    yield rid
    for n in itertools.count(2):
        yield f"{rid}#{n}"


async def _quietly(awaitable) -> None:
    try:
        await awaitable
    except Exception:  # cleanup on a failing path must not mask the original error
        pass
