"""The memory plan checked at start: on CUDA an engine runs the largest eager step its plan sets memory aside for
(`engine/memory.py` `prefill_activation_bytes`) once, before it takes requests, and fails its start when that
step's measured peak exceeds the plan, instead of running out of memory under load.

Runs on rank 0's thread, before the scheduler; at TP > 1 the runner leads the step to the followers, who run it
too (rank 0's peak, which holds the gathered logits and samples, is the one checked). The peak is
`torch.cuda.max_memory_allocated()` of the process's device above what was allocated before the step: another
engine stepping on the same device meanwhile would count too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.engine.config import EngineArgs
from k3serve.engine.memory import PoolPlan, max_step_tokens
from k3serve.engine.runner import ModelRunner
from k3serve.engine.sampler import Sampler
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from k3serve.kernels._backend import has_module, reference_forced

WARMUP_TOLERANCE = 0.01
"""How far (a fraction of the plan) the measured peak may exceed the plan before the start fails: what the plan
does not count, such as the caching allocator's rounding of every block."""
WARMUP_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)  # the sampler's widest path: a sort


class MemoryPlanError(RuntimeError):
    """The warm-up step took more device memory than the plan set aside for it."""


@dataclass(frozen=True)
class WarmupPeak:
    """One warm-up step: what the plan set aside for it and what it took."""

    planned_bytes: int  # `PoolPlan.prefill_bytes`
    measured_bytes: int  # peak allocated during the step above what was allocated before it
    num_tokens: int  # the step's tokens: `max_step_tokens`
    num_seqs: int  # its sequences, each sampled once

    @property
    def within_plan(self) -> bool:
        return self.measured_bytes <= self.planned_bytes * (1 + WARMUP_TOLERANCE)


def check_warmup_peak(peak: WarmupPeak) -> None:
    """Raise `MemoryPlanError` with planned vs measured when `peak` exceeds the plan beyond `WARMUP_TOLERANCE`."""
    if peak.within_plan:
        return
    mib = 2**20
    raise MemoryPlanError(
        f"the memory plan under-estimates a prefill step: the warm-up step of {peak.num_tokens} tokens in "
        f"{peak.num_seqs} sequences took {peak.measured_bytes / mib:.1f} MiB, the plan set aside "
        f"{peak.planned_bytes / mib:.1f} MiB (tolerance {WARMUP_TOLERANCE:.0%}); under load it would run out of "
        "memory. The estimate needs fixing (engine/memory.py prefill_activation_bytes); meanwhile cache_memory_bytes "
        "gives the pools a fixed size (no plan from the device, no check), which must leave the step its room."
    )


def warmup_skip_reason(args: EngineArgs, plan: PoolPlan) -> str | None:
    """Why an engine of `args` and `plan` runs no warm-up check (None: it runs one): the plan set nothing aside
    for a step (a CPU engine, or `cache_memory_bytes` given), or the step would not run the GPU kernels the
    estimate describes (an fp32 model, no fla, the reference kernels forced)."""
    if plan.prefill_bytes == 0:
        return "the plan sets no prefill reserve aside (a CPU engine, or cache_memory_bytes given)"
    if args.torch_dtype not in (torch.bfloat16, torch.float16):
        return f"the prefill estimate describes 16-bit models, this one is {args.torch_dtype}"
    if not has_module("fla"):
        return "fla is not installed: KDA prefill runs the reference, which the estimate does not describe"
    if reference_forced() or args.kernels == "reference":
        return "the reference kernels are forced"
    return None


def warmup_output(args: EngineArgs, plan: PoolPlan, vocab_size: int, device_bytes: int | None) -> SchedulerOutput:
    """The largest step the plan sizes: `max_step_tokens` fresh prompt tokens in `min(max_num_seqs, tokens)`
    sequences, each sampled; the first as long as one prompt may be (`max_model_len - 1`: it reaches SDPA's
    longest sequence), the rest sharing what is left evenly (none longer than the first: fewer tokens where the
    sequences cannot hold them all). Sequence i takes KDA slot i (zeroed first) and
    consecutive blocks, wrapping around the pool (sequences may share blocks: what the step writes there is never
    read, every request writes its blocks before it reads them)."""
    num_tokens = max_step_tokens(args, device_bytes)
    num_seqs = min(args.max_num_seqs, num_tokens, plan.num_slots)
    longest = args.max_model_len - 1
    first = min(num_tokens - (num_seqs - 1), longest)
    rest, extra = divmod(num_tokens - first, max(num_seqs - 1, 1))
    lengths = [first] + [min(rest + (i < extra), longest) for i in range(num_seqs - 1)]
    seqs, next_block = [], 0
    for i, length in enumerate(lengths):
        num_blocks = -(-length // plan.block_size)
        blocks = [(next_block + j) % plan.num_blocks for j in range(num_blocks)]
        next_block += num_blocks
        token_ids = [(i * 7919 + p * 104729) % vocab_size for p in range(length)]  # varied: the MoE routes them apart
        seqs.append(ScheduledSeq(request_id=f"warmup-{i}", token_ids=token_ids, num_computed_tokens=0,
                                 block_ids=blocks, slot_id=i, is_prefill=True, needs_sample=True, zero_state=True))
    return SchedulerOutput(seqs=seqs, num_batched_tokens=sum(len(s.token_ids) for s in seqs))


def measure_warmup(runner: ModelRunner, output: SchedulerOutput, planned_bytes: int) -> WarmupPeak:
    """Run `output` through `runner` and sample its rows (a fresh `Sampler`, `WARMUP_SAMPLING`); the step's peak
    device allocation above what was allocated before it. Leaves the KV blocks and KDA slots it used dirty."""
    device = runner.device
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = runner.execute(output)
    if result.sample_logits:  # rank 0
        ids = list(result.sample_logits)
        Sampler().sample(torch.stack([result.sample_logits[i] for i in ids]).float(), [WARMUP_SAMPLING] * len(ids),
                         [[] for _ in ids], [[] for _ in ids], [None] * len(ids))
    del result
    torch.cuda.synchronize(device)
    measured = torch.cuda.max_memory_allocated(device) - before
    return WarmupPeak(planned_bytes, measured, output.num_batched_tokens, len(output.seqs))


def warm_up(runner: ModelRunner, args: EngineArgs, plan: PoolPlan, vocab_size: int,
            device_bytes: int | None) -> WarmupPeak | None:
    """The start's memory check: the warm-up step measured and checked against the plan (`MemoryPlanError` when it
    exceeds it); None, running nothing, where `warmup_skip_reason` gives a reason."""
    if warmup_skip_reason(args, plan) is not None:
        return None
    peak = measure_warmup(runner, warmup_output(args, plan, vocab_size, device_bytes), plan.prefill_bytes)
    check_warmup_peak(peak)
    return peak
