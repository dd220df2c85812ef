"""Runs one scheduled step through the model: state copies, one forward pass, logits.

Every rank of a TP engine runs the step, logits included (the vocab-parallel lm_head gathers them, a
collective); only rank 0 gets them back and samples, the other ranks return empty outputs.

Prompt logprobs score every prompt row of a chunk, so their logits are made a slice of at most
`prompt_logprobs_rows` rows at a time (`engine/sampler.py` `PROMPT_LOGPROBS_ROWS`), each slice reduced to its
compact per-token results before the next one: a [chunk, vocab] tensor never exists. Every rank runs the
same slices (each one's gather is a collective).

The runner is the only place that turns the scheduler's lists into tensors (once per step,
`ForwardBatch.build`, or `DecodeGraphs.run` for a decode-only step replayed as a CUDA graph) and the
only place that touches the cache tensors outside the model.

With a model-based drafter (rank 0 only: `engine/spec/drafter.py`) the runner keeps a step's hidden states (and
the drafter's chosen layers' outputs) until the engine, which knows the step's tokens, calls `draft`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from k3serve.engine.config import EngineArgs
from k3serve.engine.cuda_graphs import DecodeGraphs, capture_decode_graphs, graphs_enabled
from k3serve.engine.memory import PoolPlan
from k3serve.engine.offload.factory import tier_data
from k3serve.engine.offload.tier import TierData
from k3serve.engine.outputs import TokenLogprobs
from k3serve.engine.sampler import PROMPT_LOGPROBS_ROWS, PromptScoring, prompt_logprobs

from k3serve.engine.scheduler_output import NO_SLOT, ScheduledSeq, SchedulerOutput
from k3serve.engine.spec.drafter import DraftRow, DraftRunner, Drafts
from k3serve.engine.tp_group import TPGroup, rank_device
from k3serve.kernels._backend import to_device_async
from k3serve.model.batch import ForwardBatch, ModelCache, VerifyRecords
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM
from k3serve.model.parallel import TensorParallel


@dataclass
class RunnerOutput:
    sample_logits: dict[str, torch.Tensor]  # request_id -> [vocab] fp32, chunks with needs_sample (rank 0)
    prompt_logprobs: dict[str, list[TokenLogprobs]]  # request_id -> [len(target_token_ids)], if asked (rank 0)
    verify_logits: dict[str, torch.Tensor] = field(default_factory=dict)  # spec rows: [1 + k, vocab] fp32 (rank 0)
    offload_results: list[int | None] = field(default_factory=list)  # [stores + loads] bytes, all ranks; None: failed


@dataclass
class _PendingCommit:
    """A step's verify rows between the forward and the commit (same step): their records, slots and spans."""

    request_ids: list[str]
    slots: list[int]
    cu_seqlens: list[int]  # [num_spec + 1] from 0
    records: list[VerifyRecords]  # one a KDA layer


def load_runner(
    args: EngineArgs, model_dir: Path, plan: PoolPlan, tp: TensorParallel, group: TPGroup | None = None
) -> ModelRunner:
    """This rank's model shard and cache pools (the same plan on every rank of an engine) on its device
    (`rank_device`), and its captured decode graphs where `graphs_enabled(args, tp)`: at TP > 1 on every
    rank or none (each one also reads its own environment), captured in step (`DecodeGraphs.capture`)."""

    def all_ranks_ok(ok: bool) -> bool:
        return ok if group is None else all(group.all_gather(ok))

    device = rank_device(args.device, tp.rank, tp.world_size)
    tp = replace(tp, dcp_size=args.decode_context_parallel_size)  # the MLA layers split their KV over DCP groups
    model = load_model(model_dir, tp, args.torch_dtype, device)
    model.use_kernels(reference=args.kernels == "reference", moe_finalize=args.moe_finalize)
    use_graphs = graphs_enabled(args, tp)
    if tp.world_size > 1 and tp.capturable:  # the same on every rank: NCCL was chosen by all of them
        use_graphs = all_ranks_ok(use_graphs)
    cache = ModelCache.allocate(
        model.config, plan.num_blocks, plan.num_slots, plan.page_size, tp.world_size, args.torch_dtype, device,
        reserve_pad_slot=use_graphs, dcp_size=plan.dcp_size,
    )
    graphs = capture_decode_graphs(model, cache, args, all_ranks_ok) if use_graphs else None
    spec = args.speculative_config
    drafter = None
    if spec is not None and spec.model is not None and tp.rank == 0:  # rank 0 alone drafts
        from k3serve.model.draft.config import DrafterConfig
        from k3serve.model.draft.loader import load_drafter

        config = DrafterConfig.from_dir(spec.model_dir)
        config.check_fits(model.config, spec.method, spec.num_speculative_tokens)
        drafter = DraftRunner(load_drafter(spec.model_dir, config, model, model_dir, device), plan.num_blocks,
                              plan.num_slots + int(use_graphs), plan.block_size, spec.num_speculative_tokens,
                              spec.draft_sample_method == "probabilistic", device)
    return ModelRunner(model, cache, group, graphs, offload=tier_data(args, cache, plan, tp, model.config),
                       drafter=drafter)


class ModelRunner:
    def __init__(
        self, model: KimiForCausalLM, cache: ModelCache, group: TPGroup | None = None,
        graphs: DecodeGraphs | None = None, prompt_logprobs_rows: int = PROMPT_LOGPROBS_ROWS,
        offload: Sequence[TierData] = (),
        drafter: DraftRunner | None = None,
    ) -> None:
        if prompt_logprobs_rows < 1:
            raise ValueError(f"prompt_logprobs_rows must be >= 1, got {prompt_logprobs_rows}")
        self.model = model
        self.cache = cache
        self.group = group  # set on rank 0 of a TP engine: every step is announced to the other ranks
        self.graphs = graphs  # decode-only steps that fit replay these instead of the eager forward
        self.device = next(model.parameters()).device
        self.prompt_logprobs_rows = prompt_logprobs_rows  # the same on every rank of an engine
        self._pending_commit: _PendingCommit | None = None  # a verify step's, until `commit_verified`
        self._kda_layers = [layer.self_attn for layer in model.model.layers if layer.is_kda]  # cache order
        self.offload = {tier.name: tier for tier in offload}  # this rank's half of each offload tier
        self.drafter = drafter  # rank 0's model-based drafter, or None
        self._drafter_inputs: tuple[torch.Tensor, torch.Tensor | None, dict[str, int]] | None = None  # see draft

    def execute(self, output: SchedulerOutput, score_prompts: dict[str, PromptScoring] | None = None) -> RunnerOutput:
        """`score_prompts`: request_id -> the prompt tokens its chunk's first rows score (prompt logprobs)."""
        score_prompts = score_prompts or {}
        if self.group is not None and self.group.is_leader:
            self.group.lead(("step", output, score_prompts))
        if self._pending_commit is not None:
            raise RuntimeError("a step ran before the previous verify step's commit_verified")
        offload_results = self._run_offload(output)  # before anything this step writes a block or a slot
        if not output.seqs:
            return RunnerOutput(sample_logits={}, prompt_logprobs={}, offload_results=offload_results)
        # [single-token chunks | verify rows | prefill chunks]: each path gets one contiguous slice of the batch.
        seqs = sorted(output.seqs, key=lambda s: 0 if s.num_scheduled_tokens == 1 else 1 if s.num_draft_tokens else 2)
        # The one zeroing of fresh slots (the model reads whatever a slot holds), all of them at once.
        self.cache.zero_slots([seq.slot_id for seq in seqs if seq.zero_state])
        for seq in seqs:
            if seq.copy_state_from_slot != NO_SLOT:
                self.cache.copy_slot(seq.copy_state_from_slot, seq.slot_id)
        aux_layers = self.drafter.aux_layer_ids if self.drafter is not None else ()
        aux = None
        if self.graphs is not None and not aux_layers and self.graphs.fits(seqs):  # verify steps never fit
            hidden = self.graphs.run(seqs)
        else:
            batch = self._build_batch(seqs)
            batch.aux_layer_ids = aux_layers
            hidden = self.model(batch, self.cache)
            if aux_layers:
                aux = torch.cat([batch.aux_hidden[i] for i in aux_layers], dim=-1)
            if batch.num_spec:
                cu, slots = batch.spec_spans()
                spec_ids = [s.request_id for s in seqs[batch.num_decode : batch.prefill_start]]
                self._pending_commit = _PendingCommit(spec_ids, slots, cu, batch.verify_records)
        for seq in seqs:
            if seq.copy_state_to_slot != NO_SLOT:
                self.cache.copy_slot(seq.slot_id, seq.copy_state_to_slot)

        starts = [0]
        for seq in seqs:
            starts.append(starts[-1] + seq.num_scheduled_tokens)
        if self.drafter is not None:
            self._drafter_inputs = (hidden, aux, {s.request_id: at for s, at in zip(seqs, starts)})
        sample_rows, row_spans = [], []  # a verify row's logits are all its rows'
        for i, s in enumerate(seqs):
            if s.needs_sample:
                first = starts[i] if s.num_draft_tokens else starts[i + 1] - 1
                row_spans.append((s.request_id, len(sample_rows), starts[i + 1] - first, s.num_draft_tokens > 0))
                sample_rows += range(first, starts[i + 1])
        logits = None
        if sample_rows:
            every_row = sample_rows == list(range(len(seqs)))  # a decode step: a slice, no index at all
            rows = slice(len(seqs)) if every_row else to_device_async(sample_rows, hidden.device)
            logits = self.model.compute_logits(hidden[rows])
        scored = {
            s.request_id: self.score_prompt(hidden[starts[i] : starts[i + 1]], score_prompts[s.request_id])
            for i, s in enumerate(seqs)
            if s.request_id in score_prompts
        }
        if self.model.tp.rank > 0:  # the logits were gathered to rank 0, which alone samples
            return RunnerOutput(sample_logits={}, prompt_logprobs={})
        return RunnerOutput(
            sample_logits={rid: logits[at] for rid, at, _, spec in row_spans if not spec},
            prompt_logprobs=scored,
            verify_logits={rid: logits[at : at + n] for rid, at, n, spec in row_spans if spec},
            offload_results=offload_results,
        )

    def close_offload(self) -> None:
        """Release this rank's offload tiers (a store client leaves the store)."""
        for tier in self.offload.values():
            tier.close()

    def _run_offload(self, output: SchedulerOutput) -> list[int | None]:
        """The step's offload stores, then its loads, on this rank; at TP > 1 the bytes of all ranks (a collective:
        every rank runs the same copies), None for a copy that failed on any rank."""
        stores, loads = output.offload_stores, output.offload_loads
        if not (stores or loads):
            return []
        done = [self.offload[op.tier].store(op, self.cache) for op in stores]
        done += [self.offload[op.tier].load(op, self.cache) for op in loads]
        if self.group is None:
            return done
        ranks = self.group.all_gather(done)
        return [None if any(r[i] is None for r in ranks) else sum(r[i] for r in ranks) for i in range(len(done))]

    def commit_verified(self, commit_lens: dict[str, int]) -> None:
        """After rejection, every rank: each verify row's KDA slot (state and conv window) advanced by its first
        commit_lens[request_id] tokens (the accepted drafts + 1; 0 leaves it as it was), in every KDA layer. Its
        rejected MLA rows lie past the request's computed tokens and are overwritten later. Once a verify step."""
        if self.group is not None and self.group.is_leader:
            self.group.lead(("commit", commit_lens))
        pending, self._pending_commit = self._pending_commit, None
        if pending is None:
            raise RuntimeError("commit_verified without a verify step to commit")
        lens = [commit_lens.get(rid, 0) for rid in pending.request_ids]
        for layer, records, recurrent, conv in zip(self._kda_layers, pending.records, self.cache.kda_recurrent,
                                                   self.cache.kda_conv):
            layer.commit_verified(records, recurrent, conv, pending.slots, pending.cu_seqlens, lens)

    def draft(self, rows: list[DraftRow]) -> dict[str, Drafts]:
        """Rank 0, after the step's tokens are known: the drafter's context rows of the step's positions and the
        drafts of the rows that ask (`DraftRow.hidden_start` is filled in here from the step's row layout).
        Once a step, never on a step without a drafter."""
        if self.drafter is None or self._drafter_inputs is None:
            raise RuntimeError("draft without a drafter or without a step to draft from")
        (hidden, aux, starts), self._drafter_inputs = self._drafter_inputs, None
        rows = [replace(r, hidden_start=starts[r.request_id]) for r in rows]
        return self.drafter.run(rows, hidden, aux)

    @property
    def has_pending_commit(self) -> bool:
        return self._pending_commit is not None

    def score_prompt(self, hidden: torch.Tensor, scoring: PromptScoring) -> list[TokenLogprobs]:
        """Row i of `hidden` [chunk, hidden] scores `scoring.target_token_ids[i]`: the lm_head, log-softmax and
        gather a slice of `prompt_logprobs_rows` rows at a time. Empty on ranks > 0, which run the same slices."""
        targets, entries = scoring.target_token_ids, []
        if len(targets) > hidden.shape[0]:
            raise ValueError(f"{len(targets)} prompt tokens to score, but the chunk has {hidden.shape[0]} rows")
        for lo in range(0, len(targets), self.prompt_logprobs_rows):
            hi = min(lo + self.prompt_logprobs_rows, len(targets))
            logits = self.model.compute_logits(hidden[lo:hi])  # [hi - lo, vocab] fp32 on rank 0, None elsewhere
            if logits is not None:
                entries += prompt_logprobs(logits, targets[lo:hi], scoring.num_top)
            del logits  # freed before the next slice's are made: one slice's logits at a time
        return entries

    def _build_batch(self, seqs: list[ScheduledSeq]) -> ForwardBatch:
        in_pass = [s.checkpoint_offset for s in seqs]
        return ForwardBatch.build(
            token_ids=[s.token_ids for s in seqs],
            num_computed=[s.num_computed_tokens for s in seqs],
            block_tables=[s.block_ids for s in seqs],
            slot_ids=[s.slot_id for s in seqs],
            block_size=self.cache.tokens_per_block,
            checkpoint_offsets=in_pass if any(off >= 0 for off in in_pass) else None,
            checkpoint_slot_ids=[s.checkpoint_slot for s in seqs] if any(off >= 0 for off in in_pass) else None,
            device=self.device,
            num_spec=sum(1 for s in seqs if s.num_draft_tokens),
        )
