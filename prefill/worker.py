"""Prefill worker: runs a prompt, samples the first token, pushes the state into a decode reservation.

    prefill(request, target)                                    decode worker
      engine: chunked prefill (adaptive budget, in-pass KDA checkpoints), first token sampled
      scheduler.on_finish -> pin the request's blocks + slot (lease)   <- before they are released
      ops = TPMapping.ops(span)                 (handshake once per decode address)
      backend.write(ops) ... poll until DONE    MLA KV + KDA recurrent + conv window land
      TransferReady(first token, checksums of what was sent)  ---->    verify, adopt, decode
      unpin: the boundary state may be reused only now

The pin is held from before the write is posted until the write has landed (or failed) AND the
decode side has answered, whatever happens to the caller meanwhile: an abandoned request still
waits for its in-flight write before its memory can be reused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass

from k3serve.engine.async_engine import AsyncEngine, GenerateRequest
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.outputs import RequestDelta
from k3serve.engine.request import Request
from k3serve.engine.sampling_params import SamplingParams
from k3serve.transfer.backend import TransferError, TransferStatus
from k3serve.transfer.backends import make_backend
from k3serve.transfer.checksum import request_checksums
from k3serve.transfer.control import DecodeControlClient, Reservation
from k3serve.transfer.layout import CacheLayout, compatibility_hash, register_cache
from k3serve.transfer.metrics import transfer_metrics
from k3serve.transfer.pins import PinManager
from k3serve.transfer.tp_map import RankCache, RequestSpan, TPMapping


@dataclass(frozen=True)
class HandoffTarget:
    """Where a request's state goes: a decode engine's control address and its reservation."""

    decode_address: str
    reservation: Reservation


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    finished: bool  # the request ended at its first token (EOS, stop, max_tokens=1): no handoff
    delta: RequestDelta | None  # the prefill engine's delta when `finished` (text, finish reason)
    num_prompt_tokens: int
    prefill_seconds: float  # queue + prompt compute, as seen by this worker
    transfer_seconds: float  # post writes -> decode acknowledged
    num_bytes: int


@dataclass
class _Peer:
    client: DecodeControlClient
    key: str
    mapping: TPMapping


class PrefillWorker:
    def __init__(
        self,
        args: EngineArgs,
        transfer: str = "local",
        lease_seconds: float = 30.0,
        transfer_timeout_s: float = 30.0,
        transfer_options: dict | None = None,
        name: str = "prefill-0",
    ) -> None:
        self.name = name
        self.engine = AsyncEngine(args)
        core = self.engine.engine
        self.lease_seconds = lease_seconds
        self.transfer_timeout_s = transfer_timeout_s
        cache = core.runner.cache
        self.backend = make_backend(transfer, **(transfer_options or {}))
        self.regions = register_cache(self.backend, cache)
        self.layout = CacheLayout.from_cache(cache, core.config, tp_rank=0, tp_size=1)
        self.compat_hash = compatibility_hash(core.config, args.torch_dtype, args.block_size)
        self.metrics = transfer_metrics().bind(model=core.model_name, role="prefill")
        self.pins = PinManager(core.scheduler.block_pool, core.scheduler.state_pool, metrics=self.metrics)
        self._held: dict[str, tuple[list[int], int]] = {}  # request id -> pinned (blocks, slot); engine thread
        self._peers: dict[str, _Peer] = {}
        self._peers_lock = threading.Lock()
        self.engine.submit(self._install_hold).result()

    # ---- the boundary state stays pinned from the end of the prompt until the handoff is done ------
    def _install_hold(self, e: LLMEngine) -> None:
        e.scheduler.on_finish = self._hold

    def _hold(self, req: Request) -> None:
        """Engine thread, as the scheduler finishes a request and before it releases anything."""
        if req.slot_id is None or req.finish_reason == "abort" or req.num_computed_tokens != req.num_prompt_tokens:
            return
        self.pins.pin(req.request_id, req.block_ids, [req.slot_id], {self.layout.tp_rank}, self.lease_seconds)
        self._held[req.request_id] = (list(req.block_ids), req.slot_id)

    def _release(self, request_id: str, reason: str | None) -> None:
        def release(e: LLMEngine) -> None:
            self._held.pop(request_id, None)
            if reason is None:
                self.pins.confirm(request_id, self.layout.tp_rank)
            else:
                self.pins.abort(request_id, reason)
        self.engine.submit(release)

    # ---- the request ------------------------------------------------------------------------
    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, target: HandoffTarget
    ) -> PrefillResult:
        """Compute the prompt, sample the first token, hand the state to `target`."""
        start = time.perf_counter()
        peer = await asyncio.to_thread(self._peer, target.decode_address)
        first_only = dataclasses.replace(params, max_tokens=1)
        last: RequestDelta | None = None
        async for delta in self.engine.generate(GenerateRequest(request_id, prompt_token_ids, first_only)):
            last = delta
        assert last is not None and last.finished
        prefill_seconds = time.perf_counter() - start
        first = last.new_token_ids[0]
        held = await self.engine.call(lambda e: self._held.get(request_id))
        ends_here = last.finish_reason != "length" or params.max_tokens == 1
        if ends_here or held is None:
            if held is not None:
                self._release(request_id, "finished at the first token")
            return PrefillResult(first, True, last, len(prompt_token_ids), prefill_seconds, 0.0, 0)
        t0 = time.perf_counter()
        num_bytes = await self._push(request_id, peer, held, target.reservation, len(prompt_token_ids), first)
        return PrefillResult(first, False, None, len(prompt_token_ids), prefill_seconds, time.perf_counter() - t0, num_bytes)

    async def _push(
        self, request_id: str, peer: _Peer, held: tuple[list[int], int], reservation: Reservation, num_tokens: int, first: int
    ) -> int:
        blocks, slot = held
        span = RequestSpan(tuple(blocks), reservation.block_ids, slot, reservation.slot_id, num_tokens)
        ops = peer.mapping.ops(span).get((self.layout.tp_rank, 0), [])
        num_bytes = sum(op.length for op in ops)
        try:
            await self._write_and_wait(peer, ops)
            view = peer.mapping.view(self.layout.tp_rank, 0)
            sums = request_checksums(
                self.engine.engine.runner.cache, self.layout, blocks, slot, num_tokens, view.heads, view.mla
            )
            await asyncio.to_thread(peer.client.transfer_ready, request_id, self.layout.tp_rank, first, num_tokens, sums)
        except BaseException as e:
            self.metrics.failure(type(e).__name__)
            self._release(request_id, f"handoff failed: {e!r}")
            await asyncio.to_thread(_abort_quietly, peer.client, request_id, f"prefill handoff failed: {e!r}")
            raise
        self.metrics.add_bytes(num_bytes)
        self._release(request_id, None)
        return num_bytes

    async def _write_and_wait(self, peer: _Peer, ops) -> None:
        """Post the writes and poll until they land. Runs to completion even when the caller is
        cancelled: memory under an in-flight one-sided write must not be released early."""
        handle = self.backend.write(peer.key, ops)
        deadline = time.monotonic() + self.transfer_timeout_s
        t0 = time.perf_counter()
        try:
            while True:
                status = self.backend.poll(handle)
                if status is TransferStatus.DONE:
                    self.metrics.observe_seconds(time.perf_counter() - t0)
                    return
                if status is TransferStatus.FAILED:
                    raise TransferError("the backend reported the write batch as failed")
                if time.monotonic() > deadline:
                    raise TransferError(f"writes did not land within {self.transfer_timeout_s} s")
                try:
                    await asyncio.sleep(0.0002)
                except asyncio.CancelledError:
                    await asyncio.shield(asyncio.to_thread(self._drain, handle, deadline))
                    raise
        finally:
            self.backend.release(handle)

    def _drain(self, handle: int, deadline: float) -> None:
        while self.backend.poll(handle) is TransferStatus.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)

    # ---- peers --------------------------------------------------------------------------------
    def _peer(self, address: str) -> _Peer:
        """Handshake once per decode engine: agent metadata, regions, layout, compatibility."""
        with self._peers_lock:
            peer = self._peers.get(address)
            if peer is not None:
                return peer
            client = DecodeControlClient(address, self.compat_hash)
            info = client.handshake(self.backend.agent_info(), self.layout.to_json(), self.layout.tp_size, self.layout.tp_rank)
            decode_layout = CacheLayout.from_json(info.layout_json)
            mapping = TPMapping(
                [RankCache(self.layout, self.regions)],
                [RankCache(decode_layout, {r.name: r for r in info.agent.regions})],
            )
            peer = _Peer(client, self.backend.connect(info.agent), mapping)
            self._peers[address] = peer
            return peer

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def load(self) -> tuple[int, int]:
        """(running, waiting) requests, for load-based routing."""
        def read(e: LLMEngine) -> tuple[int, int]:
            self.pins.expire()  # leases of abandoned handoffs end here at the latest
            return e.scheduler.num_running, e.scheduler.num_waiting

        return await self.engine.call(read)

    def shutdown(self) -> None:
        for peer in self._peers.values():
            peer.client.close()
        self.engine.shutdown()
        self.backend.close()


def _abort_quietly(client: DecodeControlClient, request_id: str, reason: str) -> None:
    try:
        client.abort(request_id, reason)
    except Exception:  # the decode side may be gone; its lease frees the reservation then
        pass
