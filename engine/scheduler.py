"""Continuous batching over paged MLA blocks and KDA state slots (CPU only, no tensors).

`Scheduler.schedule()` picks one step's work under the adaptive token budget (budget.py) and
`max_num_seqs`: running decodes, running prefills (chunked), then waiting requests strictly FCFS;
`update_from_output` applies what the runner computed. Invariant: each step every scheduled request's
`num_computed_tokens` catches up with its `num_tokens` by its chunk, and the KDA state in its working
slot advances exactly once per token (a preempted request drops its slot and recomputes). With a
`Speculator`, a decode is a verify row of 1 + k tokens (the last token and its drafts, costing 1 + k of the
budget); it advances by the accepted drafts + 1, the tokens it emits (appended one by one, the first stop
ending the run), so at every step boundary the invariant holds again. Drafts live in the scheduled step only:
preemption and aborts have none to drop. Thread: the engine's step loop only. Design (preemption, KDA checkpoints for prefix caching): docs/design/scheduler.md.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection, Literal, Mapping, Sequence

from k3serve.engine.block_pool import BlockPool, compute_block_hashes
from k3serve.engine.budget import scheduled_token_budget
from k3serve.engine.prefix_cache import MISS, PrefixCache
from k3serve.engine.request import FINISH_STATUS, Request, RequestStatus
from k3serve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from k3serve.engine.state_pool import StatePool

if TYPE_CHECKING:
    from k3serve.engine.offload.manager import Offload
    from k3serve.engine.spec.proposer import Speculator

KdaCheckpointMode = Literal["in_pass", "align", "none"]


@dataclass(frozen=True)
class SchedulerConfig:
    """One engine's scheduling limits, every field given: `engine/memory.py` `scheduler_config` makes it
    from the engine's EngineArgs (their defaults are the only ones)."""

    max_num_seqs: int
    """Most requests running at once (each holds one KDA working slot)."""
    max_num_batched_tokens: int
    """Base token budget per step; see budget.default_token_budget."""
    max_adaptive_batched_tokens: int
    """Largest budget when few requests run; equal to the base = static."""
    max_model_len: int
    """Prompt + output tokens of one request; reaching it finishes the request ("length")."""
    block_size: int
    """Tokens per MLA KV block, and the prefix-cache / KDA checkpoint granularity."""
    enable_prefix_caching: bool
    kda_checkpoint_mode: KdaCheckpointMode
    """How the KDA state at a prompt's last block boundary is captured; ignored without prefix caching."""
    eos_token_id: int | None
    long_prefill_token_threshold: int | None
    """Cap on one request's prefill chunk per step; None = no cap beyond the budget."""
    max_running_to_scale: int
    """The budget scales up only while at most this many requests are decoding."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs={self.max_num_seqs} "
                "so every running decode fits in one step"
            )
        if self.kda_checkpoint_mode not in ("in_pass", "align", "none"):
            raise ValueError(f"kda_checkpoint_mode must be 'in_pass', 'align' or 'none', got {self.kda_checkpoint_mode!r}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(f"long_prefill_token_threshold must be >= 1 or None, got {self.long_prefill_token_threshold}")
        if self.max_adaptive_batched_tokens < self.max_num_batched_tokens:
            raise ValueError(
                f"max_adaptive_batched_tokens={self.max_adaptive_batched_tokens} must be >= "
                f"max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        if self.max_running_to_scale < 0:
            raise ValueError(f"max_running_to_scale must be >= 0, got {self.max_running_to_scale}")

    @property
    def takes_kda_checkpoints(self) -> bool:
        return self.enable_prefix_caching and self.kda_checkpoint_mode != "none"


@dataclass
class _PendingCheckpoint:
    boundary_num_tokens: int
    slot_id: int
    block_hashes: list[int]  # [boundary_num_tokens // block_size]


@dataclass
class _Step:
    """What one schedule() call has decided so far."""

    token_budget: int
    num_tokens_left: int
    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    def add(self, seq: ScheduledSeq) -> None:
        (self.prefills if seq.is_prefill else self.decodes).append(seq)
        self.num_tokens_left -= seq.num_scheduled_tokens

    def remove(self, request_id: str) -> None:
        for seqs in (self.decodes, self.prefills):
            for i, seq in enumerate(seqs):
                if seq.request_id == request_id:
                    del seqs[i]
                    self.num_tokens_left += seq.num_scheduled_tokens
                    return


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_pool: BlockPool,
        state_pool: StatePool,
        prefix_cache: PrefixCache | None = None,
        on_finish: Callable[[Request], None] | None = None,
        speculator: Speculator | None = None,
        offload: Offload | None = None,
    ) -> None:
        if block_pool.block_size != config.block_size:
            raise ValueError(f"block_pool.block_size={block_pool.block_size} != config.block_size={config.block_size}")
        if block_pool.num_blocks < _cdiv(config.max_model_len, config.block_size):
            raise ValueError(
                f"block_pool.num_blocks={block_pool.num_blocks} cannot hold one request of "
                f"max_model_len={config.max_model_len} (block_size={config.block_size})"
            )
        if config.enable_prefix_caching and prefix_cache is None:
            raise ValueError("enable_prefix_caching=True needs a PrefixCache")
        self.config = config
        self.block_pool = block_pool
        self.state_pool = state_pool
        self.prefix_cache = prefix_cache if config.enable_prefix_caching else None
        self.on_finish = on_finish  # sees a finished request while it still holds its blocks and slot
        self.speculator = speculator  # drafts for decodes; None: no speculative decoding
        self.offload = offload if self.prefix_cache is not None else None  # host / store tiers of the prefix cache
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests go back to the front
        self.running: list[Request] = []  # sorted by arrival_order
        self._next_arrival_order = 0
        self._finished_request_ids: list[str] = []  # since the last schedule()
        self._pending_checkpoints: dict[str, _PendingCheckpoint] = {}  # registered after the step
        self._pending_copy_slots: dict[str, int] = {}  # hit checkpoints held until copied

    # ---- public API ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, more than "
                f"max_model_len={self.config.max_model_len}"
            )
        request.arrival_order = self._next_arrival_order
        self._next_arrival_order += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Adopt a request whose prompt was computed elsewhere (disaggregated decode): its KV and
        KDA state already sit in `request.block_ids` / `request.slot_id`, allocated from this
        scheduler's pools, and `num_computed_tokens == num_prompt_tokens` with the first output
        token appended. It joins the running set and decodes from the next step on."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        if request.slot_id is None or request.num_computed_tokens != request.num_prompt_tokens:
            raise ValueError(f"request {request.request_id!r} is not a fully prefilled request with a slot")
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(f"request {request.request_id!r} exceeds max_model_len={self.config.max_model_len}")
        request.arrival_order = self._next_arrival_order
        self._next_arrival_order += 1
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)
        self.running.sort(key=lambda r: r.arrival_order)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        """Requests to run, or offload copies begun that a step must still run (their pins go with it)."""
        return bool(self.requests) or (self.offload is not None and self.offload.has_pending)

    def schedule(self) -> SchedulerOutput:
        budget = self._token_budget()
        step = _Step(token_budget=budget, num_tokens_left=budget)
        for req in list(self.running):  # 1. decodes
            if req.status is RequestStatus.RUNNING and self._is_decode(req) and step.num_tokens_left > 0:
                drafts = self._drafts(req, step)
                self._schedule_running(req, 1 + len(drafts), step, drafts)
        for req in list(self.running):  # 2. running prefills
            if step.num_tokens_left <= 0:
                break
            if req.status is RequestStatus.RUNNING and not self._is_decode(req):
                self._schedule_running(req, self._chunk_len(req, req.num_computed_tokens, step), step)
        while (  # 3. admission, strictly FCFS
            self.waiting
            and not step.preempted_request_ids
            and step.num_tokens_left > 0
            and len(self.running) < self.config.max_num_seqs
            and self._admit(self.waiting[0], step)
        ):
            self.waiting.popleft()
        seqs = step.decodes + step.prefills
        finished, self._finished_request_ids = self._finished_request_ids, []
        stores, loads = self.offload.take_ops() if self.offload is not None else ([], [])
        return SchedulerOutput(
            seqs=seqs,
            num_batched_tokens=sum(seq.num_scheduled_tokens for seq in seqs),
            token_budget=budget,
            preempted_request_ids=step.preempted_request_ids,
            finished_request_ids=finished,
            offload_stores=stores,
            offload_loads=loads,
        )

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int], stopped_request_ids: Collection[str] = (),
        verified_token_ids: Mapping[str, list[int]] | None = None, offload_results: Sequence[int | None] = (),
    ) -> list[Request]:
        """Advance the scheduled requests by their chunks; append the tokens sampled for chunks
        that reached the end of the known tokens; return the requests that finished. A request in
        `stopped_request_ids` (its structured output is complete) finishes "stop" with its token,
        as at EOS. A verify row's tokens come in `verified_token_ids` (its accepted drafts, then the
        recovered or bonus token): it advances by their number and appends them until the first stop.
        `offload_results`: the runner's, one per offload copy of the step (`Offload.step_done`)."""
        if self.offload is not None:
            self.offload.step_done(output.offload_stores, output.offload_loads, offload_results,
                                   lambda rid: rid in self.requests and self.requests[rid].status is not RequestStatus.RUNNING)
        finished: list[Request] = []
        for seq in output.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished (aborted, stop string) since schedule()
            if req.num_computed_tokens != seq.num_computed_tokens:
                raise RuntimeError(
                    f"stale output for {req.request_id!r}: scheduled at {seq.num_computed_tokens}, "
                    f"request is at {req.num_computed_tokens}"
                )
            if seq.num_draft_tokens:
                if self._append_verified(req, (verified_token_ids or {}).get(req.request_id), seq.num_draft_tokens,
                                         req.request_id in stopped_request_ids):
                    finished.append(req)
                continue
            req.num_computed_tokens += seq.num_scheduled_tokens
            copy_slot = self._pending_copy_slots.pop(req.request_id, None)
            if copy_slot is not None:
                self.state_pool.free(copy_slot)
            checkpoint = self._pending_checkpoints.pop(req.request_id, None)
            if checkpoint is not None:
                kept = self.prefix_cache.insert(
                    checkpoint.block_hashes, req.block_ids, checkpoint.boundary_num_tokens, checkpoint.slot_id,
                    token_ids=req.all_token_ids,
                )
                if kept and self.offload is not None:  # write-through: the unit goes to the tiers next step
                    self.offload.checkpointed(req.request_id, checkpoint.block_hashes, req.block_ids, checkpoint.slot_id)
                self.state_pool.free(checkpoint.slot_id)  # now cached (or a duplicate, then free)
            if not seq.needs_sample:
                continue
            if req.request_id not in sampled_token_ids:
                raise ValueError(f"no sampled token for {req.request_id!r}, whose chunk needs_sample")
            token_id = sampled_token_ids[req.request_id]
            req.output_token_ids.append(token_id)
            stopped = req.request_id in stopped_request_ids
            status = RequestStatus.FINISHED_STOPPED if stopped else self.check_stop(req, token_id)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return finished

    def _append_verified(self, req: Request, token_ids: list[int] | None, num_drafts: int, stopped: bool) -> bool:
        """A verify row's emitted tokens appended until the first stop (`stopped`: the last one completes its
        structured output); True if that finished the request."""
        if not token_ids or len(token_ids) > num_drafts + 1:
            raise ValueError(f"verify row of {req.request_id!r} with {num_drafts} drafts needs 1..{num_drafts + 1} "
                             f"emitted tokens, got {token_ids!r}")
        req.num_computed_tokens += len(token_ids)  # the last token and the accepted drafts
        for i, token_id in enumerate(token_ids):
            req.output_token_ids.append(token_id)
            last_stops = stopped and i == len(token_ids) - 1
            status = RequestStatus.FINISHED_STOPPED if last_stops else self.check_stop(req, token_id)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                return True
        return False

    def finish_request(self, request_id: str, reason: str = "abort") -> Request | None:
        """Finish a request from outside (a stop string, an abort) in any state; frees everything.

        Call between steps. Returns None if the request is unknown or already finished.
        """
        if reason not in FINISH_STATUS:
            raise ValueError(f"reason must be one of {sorted(FINISH_STATUS)}, got {reason!r}")
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, FINISH_STATUS[reason])
        return req

    # ---- scheduling ----------------------------------------------------------------------
    def _token_budget(self) -> int:
        cfg = self.config
        num_decodes = sum(1 for req in self.running if self._is_decode(req))
        prefill_lens = [req.num_tokens - req.num_computed_tokens for req in self.running if not self._is_decode(req)]
        num_admissible = max(0, cfg.max_num_seqs - len(self.running))
        prefill_lens += [req.num_tokens for req in islice(self.waiting, num_admissible)]
        if cfg.long_prefill_token_threshold is not None:
            prefill_lens = [min(n, cfg.long_prefill_token_threshold) for n in prefill_lens]
        return scheduled_token_budget(
            cfg.max_num_batched_tokens,
            cfg.max_adaptive_batched_tokens,
            num_decodes,
            prefill_lens,
            max_running_to_scale=cfg.max_running_to_scale,
        )

    @staticmethod
    def _is_decode(req: Request) -> bool:
        return req.num_tokens - req.num_computed_tokens == 1 and req.num_computed_tokens >= req.num_prompt_tokens

    def _chunk_len(self, req: Request, num_computed: int, step: _Step) -> int:
        num_new = min(req.num_tokens - num_computed, step.num_tokens_left)
        if self.config.long_prefill_token_threshold is not None:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return num_new

    def _drafts(self, req: Request, step: _Step) -> list[int]:
        """A decode's drafts: at most K, and no more than its max_tokens, max_model_len and the step's budget
        leave room for (all of them accepted plus the bonus token)."""
        if self.speculator is None:
            return []
        limit = min(step.num_tokens_left, self.config.max_model_len - req.num_tokens) - 1
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - req.num_output_tokens - 1)
        return self.speculator.drafts(req, limit)

    def _schedule_running(self, req: Request, num_new: int, step: _Step, drafts: list[int] = ()) -> None:
        num_new = self._plan_checkpoint(req, req.num_computed_tokens, num_new, num_slots_needed=1)
        num_new_blocks = _cdiv(req.num_computed_tokens + num_new, self.config.block_size) - len(req.block_ids)
        while not self.block_pool.can_allocate(num_new_blocks):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is req:
                return
        req.block_ids += self.block_pool.allocate(max(0, num_new_blocks))
        step.add(self._make_seq(req, num_new - len(drafts), drafts))

    def _admit(self, req: Request, step: _Step) -> bool:
        """Start (or restart) the waiting head; False if it does not fit yet, or waits for an offload load."""
        loaded = self.offload.take_loaded(req.request_id) if self.offload is not None else None
        hit = loaded or MISS
        if loaded is None and self.prefix_cache is not None and getattr(req.sampling_params, "prompt_logprobs", None) is None:
            # a request that wants prompt logprobs must compute every prompt position (as vLLM v1)
            hit = self.prefix_cache.lookup(req.all_token_ids)
            if (self.offload is not None and req.request_id not in self.offload.no_offload
                    and self.offload.start_load(req.request_id, req.all_token_ids, hit.num_tokens)):
                return False  # admitted from the loaded unit once the step has copied it in
        if hit.num_tokens and loaded is None:  # hold the hit before allocating, so allocation cannot evict it
            self.block_pool.share(hit.block_ids)
            self.state_pool.share(hit.checkpoint_slot)
        num_new = self._chunk_len(req, hit.num_tokens, step)
        num_new = self._plan_checkpoint(req, hit.num_tokens, num_new, num_slots_needed=2, dry_run=True)
        num_new_blocks = _cdiv(hit.num_tokens + num_new, self.config.block_size) - len(hit.block_ids)
        if not (self.state_pool.can_allocate(1) and self.block_pool.can_allocate(num_new_blocks)):
            if loaded is not None:
                self.offload.keep_loaded(req.request_id, loaded)
            elif hit.num_tokens:
                self.block_pool.free(hit.block_ids)
                self.state_pool.free(hit.checkpoint_slot)
            return False
        req.slot_id = self.state_pool.allocate()
        req.block_ids = list(hit.block_ids) + self.block_pool.allocate(num_new_blocks)
        req.num_computed_tokens = hit.num_tokens
        if req.num_preemptions == 0:
            req.num_cached_tokens = hit.num_tokens
        self._plan_checkpoint(req, hit.num_tokens, num_new, num_slots_needed=1)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.running.sort(key=lambda r: r.arrival_order)
        seq = self._make_seq(req, num_new)
        if hit.num_tokens:
            seq.copy_state_from_slot = hit.checkpoint_slot
            self._pending_copy_slots[req.request_id] = hit.checkpoint_slot
        else:
            seq.zero_state = True
        step.add(seq)
        return True

    def _plan_checkpoint(
        self, req: Request, num_computed: int, num_new: int, *, num_slots_needed: int, dry_run: bool = False
    ) -> int:
        """If this chunk covers the prompt's last block boundary, reserve a checkpoint slot for it
        (unless dry_run) and, in "align" mode, clip the chunk to end there. Returns the chunk length."""
        cfg = self.config
        if not cfg.takes_kda_checkpoints:
            return num_new
        boundary = (req.num_prompt_tokens - 1) // cfg.block_size * cfg.block_size
        if not (boundary > 0 and num_computed < boundary <= num_computed + num_new):
            return num_new
        if not self.state_pool.can_allocate(num_slots_needed):
            return num_new  # best effort: no room for a checkpoint now
        block_hashes = compute_block_hashes(req.prompt_token_ids[:boundary], cfg.block_size)
        if self.prefix_cache.has_boundary(block_hashes, boundary):
            return num_new  # an identical prefix was checkpointed already
        if not dry_run:
            slot_id = self.state_pool.allocate()
            self._pending_checkpoints[req.request_id] = _PendingCheckpoint(boundary, slot_id, block_hashes)
        return boundary - num_computed if cfg.kda_checkpoint_mode == "align" else num_new

    def _make_seq(self, req: Request, num_new: int, drafts: list[int] = ()) -> ScheduledSeq:
        """`num_new` known tokens from num_computed_tokens on, then the drafts (a verify row: one known token)."""
        start = req.num_computed_tokens
        if start >= req.num_prompt_tokens:
            token_ids = req.output_token_ids[start - req.num_prompt_tokens : start - req.num_prompt_tokens + num_new]
        else:
            token_ids = req.all_token_ids[start : start + num_new]
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=token_ids + list(drafts),
            num_computed_tokens=start,
            block_ids=list(req.block_ids),
            slot_id=req.slot_id,
            is_prefill=not (num_new == 1 and start >= req.num_prompt_tokens),
            needs_sample=start + num_new == req.num_tokens,
            num_draft_tokens=len(drafts),
        )
        checkpoint = self._pending_checkpoints.get(req.request_id)
        if checkpoint is not None:
            if self.config.kda_checkpoint_mode == "in_pass":
                seq.checkpoint_offset = checkpoint.boundary_num_tokens - start
                seq.checkpoint_slot = checkpoint.slot_id
            else:
                seq.copy_state_to_slot = checkpoint.slot_id
        return seq

    # ---- releasing -----------------------------------------------------------------------
    def _preempt(self, req: Request, step: _Step) -> None:
        self.running.remove(req)
        step.remove(req.request_id)
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted_request_ids.append(req.request_id)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.set_finished(status)
        if self.speculator is not None:
            self.speculator.release(req.request_id)
        if self.on_finish is not None:
            self.on_finish(req)  # e.g. a prefill worker pins the boundary state before release
        self._release(req)
        del self.requests[req.request_id]
        self._finished_request_ids.append(req.request_id)

    def _release(self, req: Request) -> None:
        """Drop the request's refs; pinned blocks/slots come back when their transfer unpins."""
        self.block_pool.free(req.block_ids)
        req.block_ids = []
        if req.slot_id is not None:
            self.state_pool.free(req.slot_id)
            req.slot_id = None
        checkpoint = self._pending_checkpoints.pop(req.request_id, None)
        if checkpoint is not None:
            self.state_pool.free(checkpoint.slot_id)
        copy_slot = self._pending_copy_slots.pop(req.request_id, None)
        if copy_slot is not None:
            self.state_pool.free(copy_slot)
        if self.offload is not None:
            self.offload.release(req.request_id)

    def check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= getattr(params, "min_tokens", 0):
            eos = self.config.eos_token_id
            if eos is not None and token_id == eos and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in (params.stop_token_ids or ()):
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
