"""Prefill worker: runs a prompt to its first token and pushes its boundary state into a decode reservation.

It drives its engine through the handoff seam (`KVHandoff`): the seam reports each finished prompt's boundary
state, which is pinned under a lease until every rank's writes are confirmed; every rank of a TP engine pushes
its share (`prefill.handoff`), and decode rank 0 verifies and adopts. A failed handoff keeps its pin until the
lease ends: a write that may still land keeps its memory. The sequence is drawn in docs/design/handoff.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from k3serve.engine.config import EngineArgs
from k3serve.engine.kv_handoff import BoundaryState, CacheView, EngineStats, KVHandoff, TPGroup
from k3serve.engine.outputs import RequestDelta
from k3serve.engine.sampling_params import SamplingParams
from k3serve.prefill.handoff import HandoffJob, RankSender, RankShare
from k3serve.prefill.messages import HandoffTarget, PrefillResult
from k3serve.transfer.auth import ControlAuth, process_auth
from k3serve.transfer.backend import TransferError
from k3serve.transfer.backends import make_backend
from k3serve.transfer.checksum import flatten_rank_checksums
from k3serve.transfer.layout import CacheLayout
from k3serve.transfer.metrics import transfer_metrics
from k3serve.transfer.pins import PinManager


def make_sender(view: CacheView, transfer: str, transfer_options: dict | None, control_auth: ControlAuth | None = None
                ) -> RankSender:
    """This rank's transfer agent over its cache shard; `control_auth`: the deployment's (default this
    process's own, transfer/auth.py)."""
    layout = CacheLayout.from_view(view)
    return RankSender(make_backend(transfer, **(transfer_options or {})), view.cache, layout, layout.compat_hash,
                      control_auth=control_auth or process_auth())


class PrefillWorker:
    def __init__(
        self,
        args: EngineArgs,
        transfer: str = "local",
        lease_seconds: float = 30.0,
        transfer_options: dict | None = None,
        name: str = "prefill-0",
        group: TPGroup | None = None,
        control_auth: ControlAuth | None = None,
    ) -> None:
        """`control_auth`: the deployment's secret and mTLS files (transfer/auth.py), which the decode ranks want;
        default this process's own secret."""
        self.name = name
        self.lease_seconds = lease_seconds
        self.handoff = KVHandoff(args, group, on_prompt_done=self._hold)
        self.sender = make_sender(self.handoff.cache_view, transfer, transfer_options, control_auth)
        self.metrics = transfer_metrics().bind(model=self.handoff.model_name, role="prefill")
        self.pins = PinManager(self.handoff.pins, metrics=self.metrics)  # engine thread
        self._held: dict[str, BoundaryState] = {}  # request id -> its pinned boundary state; engine thread

    # ---- the boundary state stays pinned from the end of the prompt until the handoff is done ------
    def _hold(self, state: BoundaryState) -> None:
        """Engine thread, as the engine finishes a prompt and before it frees anything."""
        self.pins.pin(state.request_id, state.block_ids, [state.slot_id], range(self.handoff.tp_size),
                      self.lease_seconds)
        self._held[state.request_id] = state

    def _release(self, request_id: str, reason: str | None) -> None:
        """Unpin after every rank confirmed (reason None), or at once when nothing was posted."""
        def release() -> None:
            self._held.pop(request_id, None)
            if reason is None:
                for rank in range(self.handoff.tp_size):
                    self.pins.confirm(request_id, rank)
            else:
                self.pins.abort(request_id, reason)
        self.handoff.submit(release)

    # ---- the request ------------------------------------------------------------------------
    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, target: HandoffTarget
    ) -> PrefillResult:
        """Compute the prompt, sample the first token, hand the state to `target`."""
        start = time.perf_counter()
        last: RequestDelta | None = None
        first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        async for delta in self.handoff.generate(request_id, prompt_token_ids, first_only):
            last = delta
        prefill_seconds = time.perf_counter() - start
        first = last.new_token_ids[0]
        held = await self.handoff.call(lambda: self._held.get(request_id))
        if last.finish_reason != "length" or params.max_tokens == 1 or held is None:
            if held is not None:
                self._release(request_id, "finished at the first token")
            return PrefillResult(first, True, last, len(prompt_token_ids), prefill_seconds, 0.0, 0,
                                 num_cached_tokens=last.num_cached_tokens)
        job = HandoffJob(request_id, target.decode_addresses, held.block_ids, held.slot_id, target.reservation,
                         held.num_tokens)
        t0 = time.perf_counter()
        shares = await self.handoff.call(lambda: self._push_all(job))
        errors = [s.error for s in shares if s.error]
        if errors:  # the pin stays until its lease ends; the router may retry on another replica
            self.metrics.failure("write")
            raise TransferError(f"handoff of {request_id!r} failed: {'; '.join(errors)}")
        try:
            client = self.sender.peer(target.decode_addresses, request_id).leader  # decode rank 0 verifies for all ranks
            for share in shares:
                if share.checksums:  # a rank that wrote nothing is not waited for
                    await asyncio.to_thread(client.transfer_ready, request_id, share.rank, first, job.num_tokens,
                                            flatten_rank_checksums(share.checksums), target.reservation.attempt)
        except Exception:
            self._release(request_id, "decode refused the handoff")
            raise
        num_bytes = sum(s.num_bytes for s in shares)
        self.metrics.add_bytes(num_bytes)
        self._release(request_id, None)
        return PrefillResult(first, False, None, len(prompt_token_ids), prefill_seconds, time.perf_counter() - t0,
                             num_bytes, last.logprobs, last.prompt_logprobs, last.num_cached_tokens)

    def _push_all(self, job: HandoffJob) -> list[RankShare]:
        """Engine thread: every rank pushes its share now (followers: `prefill.rank`); rank 0's gathers them."""
        return self.handoff.on_all_ranks("handoff", (job,), lambda: self.sender.push(job))

    async def abort(self, request_id: str) -> None:
        await self.handoff.abort(request_id)

    async def stats(self) -> EngineStats:
        """Load and pool usage, for routing and the pool gauges."""
        def read() -> EngineStats:
            self.pins.expire()  # leases of abandoned handoffs end here at the latest
            return self.handoff.stats()

        return await self.handoff.call(read)

    async def metrics_text(self) -> str:
        """This process's k3serve metrics (transfer counters, pins), for the ingress to re-export."""
        from k3serve.cluster.replica_metrics import render_worker_metrics

        return render_worker_metrics()

    def shutdown(self) -> None:
        self.handoff.shutdown()  # stops the followers too
        self.sender.close()
