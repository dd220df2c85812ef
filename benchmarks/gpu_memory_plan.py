"""The memory plan (`engine/memory.py`) against what the K3 rank slice really allocates on one GPU, component by
component, in one process: the weights, the pools, the captured decode graphs and the engine's warm-up step
(`engine/warmup.py`: the largest step the plan sizes), that step also by phase.

    python benchmarks/gpu_memory_plan.py [--out gpu_memory_plan.json] [--layers 12] [--max-model-len 32768]
                                         [--max-num-seqs 64] [--step-tokens N] [--cache-gib 8]
                                         [--graph-batches 1,2,4,8,16,32,64] [--smoke]

Model: `gpu_engine.py`'s k3-rank-slice (one TP8 / EP8 rank of Kimi-K3, its first --layers layers, random bf16
weights with MXFP4 experts, collectives no-ops); --smoke: k3-tiny-gpu on the CPU in fp32 (checks the script,
measures nothing: every measured value is null).

One JSON line a component, {"component", "planned_bytes", "measured_bytes", "ratio"} (measured / planned):
  weights            `weight_bytes` (counted on the meta device) vs allocated growth across building the model;
  pools              the MLA blocks and KDA slots `plan_pools` gives --cache-gib vs allocated growth across
                     `ModelCache.allocate`;
  cuda_graphs        `graph_reserve_bytes` vs reserved growth across capturing --graph-batches (cached blocks
                     returned first, as `gpu_engine.py` measures it);
  warmup_step        `prefill_activation_bytes` vs the warm-up step's peak allocated above what was allocated
                     before it (`measure_warmup`, as the engine's start check runs it: the first step, autotune
                     included), with the check's verdict ("within_plan");
  warmup_step_warm   the same step again (compiled and tuned): its planned bytes leave out the autotuner's flush;
  phase:<name>       `prefill_phase_bytes` (no fixed bytes) vs the peak above the step's start while that phase
                     ran in the cold step: a layer part's module (the largest over its layers), the lm_head
                     ("logits"), the sampler ("sampling").
The logits gather is a view here (no collective), so rank 0's gathered-logits buffer that the plan counts at TP8
is not allocated: "logits" measures under its plan by that much."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import CONFIGS, build_model, rank_slice_hf  # noqa: E402
from k3serve.engine.config import EngineArgs  # noqa: E402
from k3serve.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from k3serve.engine.memory import (cache_sizes, graph_reserve_bytes, plan_pools, prefill_activation_bytes,  # noqa: E402
                                   prefill_phase_bytes, weight_bytes)
from k3serve.engine.runner import ModelRunner  # noqa: E402
from k3serve.engine.sampler import Sampler  # noqa: E402
from k3serve.engine.warmup import WARMUP_SAMPLING, WarmupPeak, warmup_output  # noqa: E402
from k3serve.kernels._backend import AUTOTUNE_FLUSH_BYTES  # noqa: E402
from k3serve.model.batch import ModelCache  # noqa: E402
from k3serve.model.config import ModelConfig  # noqa: E402
from k3serve.model.layers.kda import KimiDeltaAttention  # noqa: E402
from k3serve.model.layers.mla import MLAAttention  # noqa: E402
from k3serve.model.layers.mlp import DenseMLP, SparseMoE  # noqa: E402
from k3serve.model.layers.vocab import ParallelLMHead  # noqa: E402

BLOCK = 64
PHASE_MODULES = {KimiDeltaAttention: "kda", MLAAttention: "mla", SparseMoE: "moe", DenseMLP: "dense_mlp",
                 ParallelLMHead: "logits"}


def allocated(dev: torch.device) -> int | None:
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev)


def reserved(dev: torch.device) -> int | None:
    """What the caching allocator holds once its unused cached blocks are returned."""
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(dev)


def growth(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


class PhasePeaks:
    """Peak allocated above a step's start while each named phase runs (phases may nest: a MoE's shared DenseMLP),
    and over the whole step. Entering a phase folds the peak so far into the step's and every open phase's, then
    resets it (no host sync: the allocator counts on the host)."""

    def __init__(self, dev: torch.device) -> None:
        self.dev, self.on = dev, dev.type == "cuda"
        self.base, self.step_peak, self.phases, self.open = 0, 0, {}, []

    def _fold(self) -> None:
        peak = torch.cuda.max_memory_allocated(self.dev) - self.base
        self.step_peak = max(self.step_peak, peak)
        for entry in self.open:
            entry[1] = max(entry[1], peak)

    def start(self) -> None:
        if self.on:
            self.base, self.step_peak, self.phases, self.open = allocated(self.dev), 0, {}, []
            torch.cuda.reset_peak_memory_stats(self.dev)

    def enter(self, name: str) -> None:
        if self.on:
            self._fold()
            torch.cuda.reset_peak_memory_stats(self.dev)
            self.open.append([name, 0])

    def leave(self) -> None:
        if self.on:
            self._fold()
            name, peak = self.open.pop()
            self.phases[name] = max(self.phases.get(name, 0), peak)

    @contextlib.contextmanager
    def phase(self, name: str):
        self.enter(name)
        yield
        self.leave()

    def stop(self) -> int | None:
        if not self.on:
            return None
        torch.cuda.synchronize(self.dev)
        self._fold()
        return self.step_peak


def hook_phases(model: torch.nn.Module, peaks: PhasePeaks) -> None:
    """Each `PHASE_MODULES` module's forward a phase, and the lm_head's `compute_logits` (not a forward) "logits"."""
    for module in model.modules():
        name = PHASE_MODULES.get(type(module))
        if name is not None and name != "logits":
            module.register_forward_pre_hook(lambda m, a, name=name: peaks.enter(name))
            module.register_forward_hook(lambda m, a, o: peaks.leave())
    lm_head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    compute = lm_head.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        with peaks.phase("logits"):
            return compute(hidden)

    lm_head.compute_logits = compute_logits


def run_step(runner: ModelRunner, output, peaks: PhasePeaks) -> int | None:
    """The warm-up step (`measure_warmup`'s work) with its phases measured; the step's peak."""
    peaks.start()
    result = runner.execute(output)
    ids = list(result.sample_logits)
    logits = torch.stack([result.sample_logits[i] for i in ids]).float()
    with peaks.phase("sampling"):
        Sampler().sample(logits, [WARMUP_SAMPLING] * len(ids), [[] for _ in ids], [[] for _ in ids], [None] * len(ids))
    del result, logits
    return peaks.stop()


def emit(rows: list[dict], component: str, planned: int, measured: int | None, **extra) -> None:
    row = {"component": component, "planned_bytes": planned, "measured_bytes": measured,
           "ratio": None if measured is None else round(measured / planned, 3), **extra}
    rows.append(row)
    print(json.dumps(row), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the rows as one JSON list here too")
    parser.add_argument("--layers", type=int, default=12, help="K3's first LAYERS layers (one TP8 rank)")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--step-tokens", type=int, help="max_num_batched_tokens (default: the device's budget)")
    parser.add_argument("--cache-gib", type=float, default=8.0, help="the pools' budget")
    parser.add_argument("--graph-batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--smoke", action="store_true", help="k3-tiny-gpu on the CPU, small sizes: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.max_model_len, args.max_num_seqs, args.step_tokens, args.cache_gib = 512, 4, 256, 0.25
        args.graph_batches = "1,4"
    args.graph_batches = [int(b) for b in args.graph_batches.split(",")]
    return args


@torch.no_grad()
def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("needs a CUDA device (or --smoke)")
    dev, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    hf, tp_size = (rank_slice_hf(args.layers), 8) if cuda else (copy.deepcopy(CONFIGS["k3-tiny-gpu"][0]), 1)
    config = ModelConfig.from_hf_dict(copy.deepcopy(hf))
    device_bytes = torch.cuda.get_device_properties(dev).total_memory if cuda else None
    plan_args = EngineArgs(device="cuda", dtype="bfloat16" if cuda else "float32", tensor_parallel_size=tp_size,
                           block_size=BLOCK, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.step_tokens, cuda_graph_batch_sizes=tuple(args.graph_batches))
    rows: list[dict] = []
    print(json.dumps({"device": torch.cuda.get_device_name(dev) if cuda else "cpu (--smoke)", "tp_size": tp_size,
                      "layers": config.num_hidden_layers, "max_model_len": args.max_model_len,
                      "max_num_seqs": args.max_num_seqs}), flush=True)

    before = allocated(dev)
    model = build_model(hf, tp_size, dev, dtype)
    emit(rows, "weights", weight_bytes(config, tp_size, dtype), growth(before, allocated(dev)))

    sizes = cache_sizes(config, tp_size, dtype)
    plan = plan_pools(sizes, int(args.cache_gib * 2**30), BLOCK, plan_args.kda_slots, args.max_model_len,
                      pad_slot=True)
    before = allocated(dev)
    cache = ModelCache.allocate(config, plan.num_blocks, plan.num_slots, BLOCK, tp_size, dtype, dev,
                                reserve_pad_slot=True)
    planned_pools = plan.num_tokens * sizes.mla_bytes_per_token + (plan.num_slots + 1) * sizes.kda_bytes_per_slot
    emit(rows, "pools", planned_pools, growth(before, allocated(dev)), num_blocks=plan.num_blocks,
         num_slots=plan.num_slots)

    graphs = None
    if cuda:
        before = reserved(dev)
        graphs = DecodeGraphs(model, cache, args.graph_batches, -(-args.max_model_len // BLOCK))
        graphs.capture()
        emit(rows, "cuda_graphs", graph_reserve_bytes(config, plan_args), growth(before, reserved(dev)),
             batches=args.graph_batches)

    runner = ModelRunner(model, cache)  # eager steps: the graphs are not handed in
    output = warmup_output(plan_args, plan, config.vocab_size, device_bytes)
    planned = prefill_activation_bytes(config, plan_args, device_bytes)
    peaks = PhasePeaks(dev)
    hook_phases(model, peaks)
    cold = run_step(runner, output, peaks)
    cold_phases = dict(peaks.phases)
    step = dict(num_tokens=output.num_batched_tokens, num_seqs=len(output.seqs))
    verdict = None if cold is None else WarmupPeak(planned, cold, **step).within_plan
    emit(rows, "warmup_step", planned, cold, within_plan=verdict, **step)
    emit(rows, "warmup_step_warm", planned - AUTOTUNE_FLUSH_BYTES, run_step(runner, output, peaks), **step)
    for name, bytes_ in prefill_phase_bytes(config, plan_args, device_bytes).items():
        if name != "prompt_logprobs":  # the warm-up asks for none
            emit(rows, f"phase:{name}", bytes_, cold_phases.get(name) if cuda else None)
    del graphs
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
