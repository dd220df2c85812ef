"""The single-process engine: scheduler + runner + sampler + detokenizer, one `step()` at a time.

    step():  schedule -> run the model -> sample -> scheduler.update_from_output -> detokenize
             (stop strings finish requests) -> one RequestDelta per request that changed

A constrained request (`SamplingParams.structured_outputs`) gets its matcher at submission and its row masked
before sampling; its token then advances the matcher, which may end it ("stop") or fail it (a delta with `error`;
`engine/structured_output.py`). Its grammar is compiled off the step loop by whoever submits it (`AsyncEngine`, the
decode worker), who hands it in; without one, submission compiles it and waits (the offline `LLM`).

With `speculative_config` a decode may be a verify row (`engine/spec/`): the step runs it with the others, rejection
samples its drafts (`spec/rejection.py`), has the runner commit each accepted prefix to the KDA state
(`ModelRunner.commit_verified`, every rank) and then appends the emitted tokens, stop conditions applied token by
token (a stop string truncates the run after the token that completes it). With a model-based drafter the step
ends by drafting (`_draft`): the runner's drafter reads the hidden states of the positions the step computed and
proposes the drafts the scheduler takes at the next step.

`LLM` (offline) and `AsyncEngine` (streaming) drive it; prefill and decode workers reuse it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from k3serve.engine.block_pool import BlockPool
from k3serve.engine.config import EngineArgs
from k3serve.engine.detokenizer import IncrementalDetokenizer
from k3serve.engine.kv_events import open_kv_events
from k3serve.engine.memory import PoolPlan, plan_engine_pools, scheduler_config
from k3serve.engine.offload.factory import tier_indexes
from k3serve.engine.offload.manager import Offload
from k3serve.engine.offload.metrics import offload_metrics
from k3serve.engine.outputs import EngineStats, RequestDelta, TokenLogprobs
from k3serve.engine.prefix_cache import PrefixCache
from k3serve.engine.prompt_check import check_prompt
from k3serve.engine.request import Request, RequestStatus
from k3serve.engine.runner import load_runner
from k3serve.engine.tp_group import TPGroup
from k3serve.engine.warmup import MemoryPlanError, WarmupPeak, warm_up
from k3serve.engine.sampler import PromptScoring, Sampler, token_logprobs
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.seeds import position_seed
from k3serve.engine.scheduler import Scheduler
from k3serve.engine.spec.metrics import SpecDecodeStats, spec_decode_metrics
from k3serve.engine.spec.drafter import DraftRow
from k3serve.engine.spec.proposer import Speculator, can_speculate
from k3serve.engine.spec.rejection import rejection_sample
from k3serve.engine.state_pool import StatePool
from k3serve.engine.structured_output import ConstraintViolationError, StructuredOutputs
from k3serve.engine.structured_output import Verdict as StructuredVerdict
from k3serve.engine.structured_output_metrics import grammar_compile_metrics
from k3serve.model.config import ModelConfig
from k3serve.model.parallel import TensorParallel
from k3serve.model.packaged import resolve_model_dir
from k3serve.model.presets import PRESETS
from k3serve.model.tokenizer import Tokenizer


@dataclass
class _Tracked:
    """Engine-side state of one request that the scheduler does not need."""

    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    prompt: str | None
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)


class LLMEngine:
    """`group`: rank 0's TP group when the engine spans several ranks (the followers run
    `engine.tp_group.follow_forever`); None for a single-rank engine. `on_finish`: the scheduler's hook
    (`Scheduler.on_finish`, engine thread). `before_step` (engine thread): called before each step schedules,
    returns {request_id: why} of the requests to fail now (a decode worker's integrity checks). On CUDA the start
    runs one warm-up step and raises `engine.warmup.MemoryPlanError` when it exceeds the memory plan (`warmup`:
    what it measured)."""

    def __init__(
        self, args: EngineArgs, group: TPGroup | None = None, on_finish: Callable[[Request], None] | None = None,
        before_step: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        self.args = args
        self.before_step = before_step
        torch.manual_seed(args.seed)
        self.model_dir = resolve_model_dir(args.model, args.seed, args.model_cache_dir)
        self.model_name = args.served_model_name or (args.model if args.model in PRESETS else self.model_dir.name)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        if args.max_model_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={args.max_model_len} exceeds the model's max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        spec = args.speculative_config
        if spec is not None and spec.model is not None:  # a drafter that does not fit fails before any loading
            from k3serve.model.draft.config import DrafterConfig

            DrafterConfig.from_dir(spec.model_dir).check_fits(self.config, spec.method, spec.num_speculative_tokens)
        if (group.world_size if group else 1) != args.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size} but the TP group has "
                             f"{group.world_size if group else 1} ranks")
        self.plan = self._plan_pools()
        if group is not None:
            group.lead(("plan", self.plan))  # every rank sizes its pools alike
        tp = group.tensor_parallel(args.device) if group is not None else TensorParallel(0, args.tensor_parallel_size)
        self.runner = load_runner(args, self.model_dir, self.plan, tp, group)
        try:  # the plan checked against the largest step it sizes (CUDA): MemoryPlanError now, not an OOM under load
            self.warmup: WarmupPeak | None = warm_up(self.runner, args, self.plan, self.config.vocab_size,
                                                     _device_memory(args.device))
        except MemoryPlanError:
            if group is not None:  # the followers leave their loop rather than wait for a step
                group.lead(("stop",))
                group.close()
            raise
        block_pool, state_pool = BlockPool(self.plan.num_blocks, args.tokens_per_block), StatePool(self.plan.num_slots)
        prefix_cache = PrefixCache(block_pool, state_pool) if args.enable_prefix_caching else None
        self.kv_events = open_kv_events(args) if prefix_cache is not None else None
        if self.kv_events is not None:
            prefix_cache.publish_events(self.kv_events)
        tiers = (tier_indexes(args, self.runner.cache, self.plan, self.runner.offload, self.config)
                 if prefix_cache is not None else [])
        self.offload = Offload(tiers, prefix_cache, self.model_name) if tiers else None
        offload_metrics()  # its families are declared (no series) in every engine, as speculative decoding's
        spec = args.speculative_config
        self.speculator = Speculator(spec) if spec is not None else None
        self.spec_stats = SpecDecodeStats(spec_decode_metrics(), self.model_name)
        self.scheduler = Scheduler(
            scheduler_config(args, _device_memory(args.device), self.tokenizer.eos_token_id),
            block_pool,
            state_pool,
            prefix_cache,
            on_finish,
            self.speculator,
            self.offload,
        )
        self.sampler = Sampler(eos_token_id=self.tokenizer.eos_token_id)
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.config.vocab_size,
                                                    pin_memory=args.device.startswith("cuda"),
                                                    metrics=grammar_compile_metrics().bind(self.model_name))
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[RequestDelta] = []  # deltas produced between steps (handoff first tokens)
        self._ids = itertools.count()
        self.num_preemptions = 0  # requests preempted so far (each recomputes its context)

    def _plan_pools(self) -> PoolPlan:
        args, usable, total = self.args, None, _device_memory(self.args.device)
        if args.device.startswith("cuda") and args.cache_memory_bytes is None:
            free, _ = torch.cuda.mem_get_info(torch.device(args.device))
            usable = int(free - (1 - args.gpu_memory_utilization) * total)
        return plan_engine_pools(self.config, args, usable, total)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, grammar: Any = None
    ) -> str:
        """Queue a request; returns its id. Raises ValueError for a prompt the engine cannot serve, or a
        structured output constraint it cannot compile. `grammar`: the constraint's compiled grammar, from
        `structured_outputs.compiler.compile_async`; without it a constrained request is compiled now, which
        holds up the step loop (a compile at K3's vocabulary is slow, the engine's first one slower still)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._tracked:
            raise ValueError(f"duplicate request_id {request_id!r}")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(token_ids, params, self.config.vocab_size, self.args.max_model_len)
        if params.max_tokens is None:  # until the context is full
            params = _with_max_tokens(params, self.args.max_model_len - len(token_ids))
        self.structured_outputs.add(request_id, params, grammar)
        self.scheduler.add_request(Request(request_id, token_ids, params))
        self._tracked[request_id] = _Tracked(
            params=params,
            detokenizer=self._detokenizer(token_ids, params),
            prompt=text,
        )
        return request_id

    # ---- disaggregated decode: a reservation, then a request whose prompt ran elsewhere -------
    def reserve(self, num_tokens: int) -> tuple[list[int], int] | None:
        """Blocks for `num_tokens` of KV plus one KDA slot, for a handoff to write into; None if
        they are not free now (the caller answers 'no capacity' rather than waiting)."""
        num_blocks = -(-num_tokens // self.args.tokens_per_block)
        blocks, states = self.scheduler.block_pool, self.scheduler.state_pool
        if num_tokens + 1 > self.args.max_model_len or not (blocks.can_allocate(num_blocks) and states.can_allocate(1)):
            return None
        return blocks.allocate(num_blocks), states.allocate()

    def cancel_reservation(self, block_ids: list[int], slot_id: int) -> None:
        self.scheduler.block_pool.free(block_ids)
        self.scheduler.state_pool.free(slot_id)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
        block_ids: list[int],
        slot_id: int,
        grammar: Any = None,
    ) -> None:
        """Continue a request whose prompt was computed by a prefill engine and whose KV and KDA
        state now sit in the reserved `block_ids` / `slot_id`. Decode starts at the first sampled
        token: no prompt token is ever applied to the state again. Takes ownership of the
        reservation (freed when the request finishes) unless it raises (ValueError: a prompt or
        constraint this engine cannot serve; `grammar` as in `add_request`). A constrained request's
        matcher takes the first token now: a token its constraint rejects fails the request, one that
        completes it ends it."""
        check_prompt(prompt_token_ids, params, self.config.vocab_size, self.args.max_model_len)
        if params.max_tokens is None:
            params = _with_max_tokens(params, self.args.max_model_len - len(prompt_token_ids))
        self.structured_outputs.add(request_id, params, grammar)
        request = Request(
            request_id, prompt_token_ids, params, output_token_ids=[first_token_id],
            num_computed_tokens=len(prompt_token_ids), block_ids=list(block_ids), slot_id=slot_id,
        )
        if self.runner.drafter is not None:  # its drafter context starts at the first decode step (design note)
            self.runner.drafter.forget(block_ids)
        self.scheduler.add_running(request)
        self._tracked[request_id] = _Tracked(
            params=params,
            detokenizer=self._detokenizer(prompt_token_ids, params),
            prompt=None,
        )
        verdict = self.structured_outputs.accept_sampled({request_id: first_token_id})
        if verdict.failed:
            self._pending.append(self._end(request_id, error=verdict.failed[request_id]))
            return
        status = (RequestStatus.FINISHED_STOPPED if verdict.terminated
                  else self.scheduler.check_stop(request, first_token_id))
        if status is not None:  # the first token already ends it (prefill normally catches this)
            self.scheduler.finish_request(request_id, status.finish_reason)
        self._pending.append(self._delta(request_id, [first_token_id], [None], request if status is not None else None))

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Finish a request wherever it is and free everything it holds.

        Returns its last delta (no new tokens, held-back text flushed, finish_reason "abort") for
        a streaming caller to end the stream with; None (falsy) if the request is unknown.
        """
        if request_id not in self._tracked:
            return None
        self._pending = [d for d in self._pending if d.request_id != request_id]  # nothing after the last delta
        return self._end(request_id)

    def _end(self, request_id: str, error: str | None = None) -> RequestDelta:
        """Finish a tracked request as aborted, or as failed with `error`, wherever it is; its last delta."""
        tracked = self._forget(request_id)
        request = self.scheduler.finish_request(request_id, "abort")
        return RequestDelta(
            request_id=request_id,
            new_token_ids=[],
            new_text=tracked.detokenizer.finish(),
            finished=True,
            finish_reason="abort",
            logprobs=None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            error=error,
        )

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        """A request's detokenizer. A constrained output is its constraint's language from its first byte: the
        bytes of a character the prompt left unfinished are not joined to it, as they are to free text."""
        prompt_tail = prompt_token_ids if params.structured_outputs is None else None
        return IncrementalDetokenizer.for_request(self.tokenizer, prompt_tail, params)

    def _forget(self, request_id: str) -> _Tracked:
        """The engine's state of a request that ended, its matcher and drafter state included, dropped."""
        self.structured_outputs.release(request_id)
        if self.runner.drafter is not None:
            self.runner.drafter.release(request_id)
        return self._tracked.pop(request_id)

    def stats(self, num_reserved: int = 0) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, num_free_blocks=s.block_pool.num_free_blocks,
            num_free_slots=s.state_pool.num_free, block_usage=s.block_pool.usage, slot_usage=s.state_pool.usage,
            num_reserved=num_reserved, settings=self.settings(),
            spec_mean_acceptance_length=self.spec_stats.mean_acceptance_length,
        )

    def settings(self) -> dict[str, str]:
        """What this engine runs with, its defaults resolved, as strings by name (the labels of the ingress's
        `k3serve:engine_config_info`, which `k3serve status` prints): its limits, and the MLA blocks and KDA slots
        its pools were given."""
        config = self.scheduler.config
        return {"max_num_seqs": str(config.max_num_seqs), "max_num_batched_tokens": str(config.max_num_batched_tokens),
                "enable_prefix_caching": str(config.enable_prefix_caching).lower(),
                "kda_checkpoint_mode": config.kda_checkpoint_mode, "num_gpu_blocks": str(self.plan.num_blocks),
                "num_kda_slots": str(self.plan.num_slots), "block_size": str(config.block_size),
                "cuda_graphs": str(self.runner.graphs is not None).lower(),
                "speculative_config": "none" if self.speculator is None else
                f"{self.speculator.config.method}:{self.speculator.config.num_speculative_tokens}"}

    def close(self) -> None:
        """Release the TP followers (they exit their loop), the process group and the compile threads."""
        self.structured_outputs.close()
        self.runner.close_offload()
        if self.kv_events is not None:
            self.kv_events.close()
        group = self.runner.group
        if group is not None:
            group.lead(("stop",))
            group.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        deltas, self._pending = self._pending, []
        if deltas:  # handoff first tokens reach their clients now, not after the next forward pass
            return deltas
        refused = [] if self.before_step is None else [
            self._end(rid, error=why) for rid, why in self.before_step().items() if rid in self._tracked]
        output = self.scheduler.schedule()
        self.num_preemptions += len(output.preempted_request_ids)
        if output.is_empty:
            return refused
        result = self.runner.execute(output, self._prompt_scoring(output))
        for request_id, entries in result.prompt_logprobs.items():
            self._tracked[request_id].prompt_logprobs.extend(entries)

        ids = list(result.sample_logits)
        sampled = {}
        logprobs: dict[str, TokenLogprobs | None] = {}
        if ids:
            reqs = [self.scheduler.requests[i] for i in ids]
            out = self.sampler.sample(
                torch.stack([result.sample_logits[i] for i in ids]).float(),
                [self._tracked[i].params for i in ids],
                [r.output_token_ids for r in reqs],
                [r.prompt_token_ids for r in reqs],
                [_position_generator(self._tracked[i].params.seed, r.num_output_tokens) for i, r in zip(ids, reqs)],
                token_mask=self.structured_outputs.token_mask(ids),
            )
            sampled = dict(zip(ids, out.sampled_token_ids))
            logprobs = dict(zip(ids, out.logprobs))
        verified, verified_logprobs, checked = self._verify(output, result.verify_logits)
        num_outputs = {rid: self.scheduler.requests[rid].num_output_tokens for rid in verified}
        verdict = self.structured_outputs.accept_sampled(sampled)
        failures = verdict.failed | checked.failed
        failed = [self._end(rid, error=why) for rid, why in failures.items()]  # update_from_output skips them
        verified = {rid: tokens for rid, tokens in verified.items() if rid not in failures}
        finished = {r.request_id: r for r in self.scheduler.update_from_output(
            output, sampled, verdict.terminated | checked.terminated, verified, result.offload_results)}
        deltas = refused + failed + [self._delta(rid, [token], [logprobs.get(rid)], finished.get(rid))
                           for rid, token in sampled.items() if rid not in verdict.failed]
        for rid, tokens in verified.items():  # the tokens the scheduler appended: up to the first stop
            done = finished.get(rid)
            appended = (done or self.scheduler.requests[rid]).output_token_ids[num_outputs[rid]:]
            entries = verified_logprobs.get(rid) or [None] * len(tokens)
            deltas.append(self._delta(rid, appended, entries[: len(appended)], done))
        if self.runner.drafter is not None:
            self._draft(output)
        return deltas

    def _draft(self, output) -> None:
        """The drafter's turn at the end of a step: the context rows of every position the step computed for a
        request still running, and K drafts for those now decoding that may speculate (stored for the scheduler)."""
        rows = []
        for seq in output.seqs:
            req = self.scheduler.requests.get(seq.request_id)
            if req is None or req.is_finished:
                continue
            n, end = seq.num_computed_tokens, req.num_computed_tokens
            if end <= n:
                continue
            decoding = end == req.num_tokens - 1 and can_speculate(req)
            rows.append(DraftRow(req.request_id, n, end - n, req.all_token_ids, list(req.block_ids), req.slot_id,
                                 req.sampling_params if decoding else None, req.num_output_tokens))
        self.speculator.proposer.store(self.runner.draft(rows))

    def _verify(self, output, verify_logits: dict[str, torch.Tensor]
                ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs | None]], StructuredVerdict]:
        """Rejection-sample each verify row's drafts (a constrained row's logits masked row by row, as its matcher
        would mask them one step at a time) and commit the accepted prefixes to the KDA state (every rank): the
        tokens each row emits, up to the one completing its constraint; their logprobs (raw, each from its own
        row) where asked; which constraints completed or failed."""
        checked = StructuredVerdict(set(), {})
        if not self.runner.has_pending_commit:
            return {}, {}, checked
        drafts = {seq.request_id: seq.token_ids[1:] for seq in output.seqs if seq.num_draft_tokens}
        emitted: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs | None]] = {}
        for rid, rows in verify_logits.items():
            params = self._tracked[rid].params
            logits = rows.float().clone(memory_format=torch.contiguous_format)
            mask = self.structured_outputs.verify_mask(rid, drafts[rid])
            if mask is not None:
                mask.apply(logits)
            q = getattr(self.speculator.proposer, "draft_probs", None)
            verdict = rejection_sample(logits, drafts[rid], params, self.scheduler.requests[rid].num_output_tokens,
                                       q(rid, len(drafts[rid])) if q is not None else None)
            emitted[rid] = verdict.token_ids
            self.spec_stats.record(len(drafts[rid]), verdict.num_accepted)
            if mask is not None:
                try:
                    taken, complete = self.structured_outputs.accept_run(rid, verdict.token_ids)
                except ConstraintViolationError as e:
                    checked.failed[rid] = str(e)
                    continue
                emitted[rid] = verdict.token_ids[:taken]
                if complete:
                    checked.terminated.add(rid)
            if params.logprobs is not None:
                logprobs[rid] = token_logprobs(rows[: len(emitted[rid])].float(), emitted[rid], params.logprobs)
        self.runner.commit_verified({rid: len(tokens) for rid, tokens in emitted.items() if rid not in checked.failed})
        return emitted, logprobs, checked

    def _delta(self, request_id: str, token_ids: list[int], logprobs: list[TokenLogprobs | None],
               done: Request | None) -> RequestDelta:
        """The delta of a request's new tokens (one, or a verify row's run); a stop string ends the run at the
        token that completes it, the tokens after it dropped."""
        tracked = self._tracked[request_id]
        detok = tracked.detokenizer
        text, num_dropped = "", 0
        for i, token_id in enumerate(token_ids):
            text += detok.push(token_id)
            if detok.stopped_by is not None:
                num_dropped = len(token_ids) - i - 1
                token_ids, logprobs = token_ids[: i + 1], logprobs[: i + 1]
                break
        request = done or self.scheduler.requests[request_id]
        finish_reason, stop_reason = None, None
        if detok.stopped_by is not None:  # a stop string wins, even on the step that hit max_tokens
            if num_dropped:  # appended after the stop string: never output
                del request.output_token_ids[-num_dropped:]
            if done is None:
                self.scheduler.finish_request(request_id, "stop")
            finish_reason, stop_reason = "stop", detok.stopped_by
        elif done is not None:
            text += detok.finish()
            finish_reason = done.finish_reason
            if finish_reason == "stop" and token_ids[-1] != self.tokenizer.eos_token_id:
                stop_reason = token_ids[-1]  # a stop_token_id (EOS reports None, as in vLLM)
        if finish_reason is not None:
            self._forget(request_id)
        return RequestDelta(
            request_id=request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            logprobs=None if all(entry is None for entry in logprobs) else logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            stop_reason=stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=tracked.prompt_logprobs if request.num_output_tokens == 1 and tracked.params.prompt_logprobs is not None else None,
        )

    def _prompt_scoring(self, output) -> dict[str, PromptScoring]:
        """The prompt tokens each prefill chunk scores, for the requests that asked for prompt logprobs: row i of
        a chunk starting at p scores prompt token p + i + 1 (the runner makes those logits a slice at a time)."""
        wanted = {}
        for seq in (s for s in output.seqs if s.is_prefill):
            tracked = self._tracked[seq.request_id]
            if tracked.params.prompt_logprobs is None:
                continue
            start = seq.num_computed_tokens
            if start == 0:
                tracked.prompt_logprobs = [None]
            if len(tracked.prompt_logprobs) != start + 1:
                continue  # a prefix-cache hit skipped these positions; they stay unscored
            prompt = self.scheduler.requests[seq.request_id].prompt_token_ids
            targets = prompt[start + 1 : start + seq.num_scheduled_tokens + 1]
            if targets:
                wanted[seq.request_id] = PromptScoring(targets, tracked.params.prompt_logprobs)
        return wanted


def _position_generator(seed: int | None, num_output_tokens: int) -> torch.Generator | None:
    """A seeded request's generator for one output position (`engine/seeds.py`); None unseeded."""
    if seed is None:
        return None
    return torch.Generator().manual_seed(position_seed(seed, num_output_tokens))


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, max_tokens=max_tokens)


def _device_memory(device: str) -> int | None:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return None
