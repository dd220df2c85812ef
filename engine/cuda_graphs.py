"""Decode steps as CUDA graphs: one captured graph per decode batch size ("bucket"), replayed instead of launching
the step's kernels one by one from Python (eager decode is host-bound).

A decode-only step (every sequence one new token after a cached context, no KDA checkpoint) is padded up to the
smallest bucket that holds it; `StaticDecodeInputs` (model/batch.py) keeps its inputs at fixed addresses and
makes the padding rows harmless (no cache read, MLA writes skipped, KDA step on the cache's pad slot). The
memory plan counts the pad slot and the graphs' memory (`engine/memory.py` `graph_reserve_bytes`). Capture
warms each bucket up eagerly, then records it, largest first, into one shared pool; a host sync while recording
raises. Graphs are used where `graphs_enabled` says (CUDA, bf16, not `enforce_eager`, reference kernels not
forced, NCCL collectives at TP > 1); a TP engine's ranks capture and replay the same buckets in step.
Capture, replay and teardown across ranks, and why: docs/design/cuda_graphs.md.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch

from k3serve.engine.config import EngineArgs
from k3serve.engine.scheduler_output import ScheduledSeq
from k3serve.engine.tp_group import nccl_requested
from k3serve.kernels._backend import reference_forced
from k3serve.model.batch import ModelCache, StaticDecodeInputs
from k3serve.model.model import KimiForCausalLM
from k3serve.model.parallel import TensorParallel


def graphs_off_reason(args: EngineArgs) -> str | None:
    """Why `args` keep an engine from capturing decode graphs, or None when they let it (the memory plan sets
    their memory aside then): at TP > 1 only where this process asks for NCCL collectives, the default (gloo's
    cannot be recorded; `tp_group.py`)."""
    if args.enforce_eager:
        return "enforce_eager"
    if not args.device.startswith("cuda"):
        return "not on CUDA"
    if args.torch_dtype != torch.bfloat16:
        return "not bf16"
    if args.kernels == "reference" or reference_forced():
        return "reference kernels forced"
    if args.tensor_parallel_size > 1 and not nccl_requested():
        return "TP > 1 with K3SERVE_TP_NCCL=0: gloo collectives"
    return None


def graphs_allowed(args: EngineArgs) -> bool:
    """Whether `args` let an engine capture decode graphs (`graphs_off_reason` is None)."""
    return graphs_off_reason(args) is None


def graphs_enabled(args: EngineArgs, tp: TensorParallel | None = None) -> bool:
    """Whether an engine run with `args` captures them: allowed, and its collectives capturable. A TP
    engine's group is known only once its ranks have joined: without its `tp` the answer is no."""
    return graphs_allowed(args) and (args.tensor_parallel_size == 1 or (tp is not None and tp.capturable))


def _alone(ok: bool) -> bool:
    """`all_ranks_ok` of a one-rank engine: its own outcome."""
    return ok


class DecodeGraphs:
    """Fixed-shape decode steps for `batch_sizes` over one model and cache.

    `run` pads the step to its bucket and replays that bucket's graph; before `capture()` (and on a CPU,
    where nothing is captured) it runs the very same padded step eagerly, which is how the CPU tests hold
    the graph body equal to the plain eager path. `replays` counts replays per bucket (a silent fallback
    to the eager path shows as none), `num_padding_rows` the padding rows run so far."""

    @torch.inference_mode()
    def __init__(self, model: KimiForCausalLM, cache: ModelCache, batch_sizes: Sequence[int], max_blocks: int) -> None:
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # first: `__del__` reads it whatever fails below
        if cache.pad_slot is None:
            raise ValueError("fixed-shape decode needs a pad slot: ModelCache.allocate(..., reserve_pad_slot=True)")
        if not batch_sizes or any(b < 1 for b in batch_sizes) or list(batch_sizes) != sorted(set(batch_sizes)):
            raise ValueError(f"batch_sizes must be strictly increasing positive integers, got {batch_sizes}")
        self.model, self.cache = model, cache
        self.batch_sizes = tuple(batch_sizes)
        self.max_blocks = max_blocks
        device = next(model.parameters()).device
        self.inputs = StaticDecodeInputs(self.batch_sizes[-1], max_blocks, cache.tokens_per_block, cache.pad_slot,
                                         device)
        self._hidden = torch.zeros(self.batch_sizes[-1], model.config.hidden_size, dtype=model.dtype, device=device)
        self.replays: Counter[int] = Counter()
        self.num_padding_rows = 0

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    @property
    def num_replays(self) -> int:
        return sum(self.replays.values())

    def __del__(self) -> None:
        """The graphs go while the model, and so its NCCL group, is still held here (module docstring)."""
        self._graphs.clear()

    def fits(self, seqs: list[ScheduledSeq]) -> bool:
        """A decode-only step within the largest bucket (and the GPU kernels not overridden)."""
        if reference_forced() and self.model.tp.world_size > 1:
            raise RuntimeError("reference kernels forced on one rank of a TP engine that replays CUDA graphs: the "
                               "other ranks would replay while this one ran eagerly; run it with enforce_eager")
        return (0 < len(seqs) <= self.batch_sizes[-1] and not reference_forced()
                and all(s.num_scheduled_tokens == 1 and s.num_computed_tokens > 0 and s.checkpoint_offset < 0
                        and len(s.block_ids) <= self.max_blocks for s in seqs))

    @torch.inference_mode()
    def run(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """hidden [len(seqs), hidden_size] of a step that `fits` (a view of the output buffer, valid until
        the next run). The state copies around the forward are the caller's, as in the eager path."""
        n = len(seqs)
        bucket = next(b for b in self.batch_sizes if b >= n)
        self.inputs.load([s.token_ids[0] for s in seqs], [s.num_computed_tokens for s in seqs],
                         [s.block_ids for s in seqs], [s.slot_id for s in seqs], bucket)
        self.num_padding_rows += bucket - n
        graph = self._graphs.get(bucket)
        if graph is None:
            self._step(bucket)
        else:
            graph.replay()
            self.replays[bucket] += 1
        return self._hidden[:n]

    @torch.inference_mode()
    def capture(self, all_ranks_ok: Callable[[bool], bool] = _alone) -> None:
        """Warm up and record every bucket, largest first, into one shared memory pool. `all_ranks_ok(ok)`:
        every rank's `ok` and-ed (a TP engine's gloo group), called the same number of times on every rank:
        before the first warm-up (every rank holds its shard: the warm-ups' collectives will be met) and
        after each recording, whose failure anywhere then raises everywhere before another warm-up."""
        self.inputs.load([], [], [], [], self.batch_sizes[-1])  # every row padding: only the pad slot is written
        all_ranks_ok(True)
        pool = None
        for bucket in reversed(self.batch_sizes):
            self._step(bucket)  # warm-up: Triton compiles and autotunes for this shape
            graph, failure = torch.cuda.CUDAGraph(), None
            try:
                with torch.cuda.graph(graph, pool=pool), _host_syncs_raise():
                    self._step(bucket)
            except RuntimeError as e:
                failure = e
            if not all_ranks_ok(failure is None):
                raise failure or RuntimeError(f"another TP rank failed to capture batch size {bucket} (its warning "
                                              "says why)")
            pool = graph.pool() if pool is None else pool
            self._graphs[bucket] = graph
        torch.cuda.synchronize()

    def _step(self, bucket: int) -> None:
        """The graph body: one padded decode forward into the output buffer."""
        self._hidden[:bucket].copy_(self.model(self.inputs.batch(bucket), self.cache))


@contextlib.contextmanager
def _host_syncs_raise() -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def capture_decode_graphs(
    model: KimiForCausalLM, cache: ModelCache, args: EngineArgs, all_ranks_ok: Callable[[bool], bool] = _alone,
) -> DecodeGraphs | None:
    """The engine's captured decode graphs; None, with a warning that names the cause, when capturing
    fails (e.g. an op without a sync-free GPU kernel for this model) on this rank or another
    (`DecodeGraphs.capture`): the engine then runs eagerly."""
    graphs = DecodeGraphs(model, cache, args.graph_batch_sizes, -(-args.max_model_len // args.tokens_per_block))
    try:
        graphs.capture(all_ranks_ok)
    except RuntimeError as e:
        warnings.warn(f"CUDA graphs off, decode steps run eagerly: capturing the decode step failed: {e}",
                      stacklevel=2)
        return None
    return graphs
