"""One decode step of the engine's model on one GPU: ours eager (the GPU kernels), ours replayed as a CUDA
graph (`engine/cuda_graphs.py`, the engine's default on CUDA), and the same model and caches with the torch
reference ops forced (`reference_kernels()`); by default issue 7's row: k3-rank-slice, first 12 layers of
K3, 8192 cached tokens per sequence, batch 1 / 2 / 4 / 8 / 16 / 32 / 64.

    python benchmarks/gpu_engine.py [--out gpu_engine.json] [--configs k3-rank-slice,k3-tiny-gpu] [--layers 12]
                                    [--ctx 8192] [--batches 1,2,4,8,16,32,64] [--reference-batches 1,8,64]
                                    [--reference-cap-s 15] [--profile] [--profile-batches 1,64]
                                    [--budget-s 270] [--max-model-len 8192] [--smoke]

Models (random weights generated in memory on the GPU: model construction, then a random init of every
parameter; routed experts through `quantize_mxfp4`; no checkpoint is written):

  k3-tiny-gpu     `model.presets.K3_TINY_GPU`: 7 layers, hidden 256, KDA 12 x 128, MLA latent 512 + 64,
                  8 MXFP4 experts of 128 x 128 (the GPU engine tests' model).
  k3-rank-slice   one rank of Kimi-K3 at TP8 / EP8, the first --layers layers in K3's order (layer 1: KDA +
                  dense MLP, then KDA + MoE with MLA + MoE at every 4th layer: 12 layers = 9 KDA + 3 MLA, 11
                  MoE): KDA 12 of 96 heads, MLA 12 of 96 heads, dense MLP 4224 of 33792, 112 local of 896 MXFP4
                  experts (latent 3584, intermediate 3072, top-16), shared experts 768 of 6144, hidden 7168; the
                  vocab-parallel embedding and lm_head hold 20480 of the 163840 rows.
                  Collectives are no-ops: this times one rank's compute. 12 layers hold ~25 GB of weights.

Step = `ForwardBatch.build` (host lists -> device tensors) + `model(batch, cache)` + `compute_logits`,
synchronized, wall clock, median; the caches hold --ctx random tokens per sequence (MLA blocks and KDA
state), the step appends the next one. Graphs: `DecodeGraphs` captured for every batch size (no padding),
block tables as wide as --max-model-len (as in the engine), step = `DecodeGraphs.run` (inputs into the static
buffers + replay) + `compute_logits`; capture time (warm-up + record, all sizes) reported.
Device ms beside each wall time (CUDA only; None on a CPU): the median over 15 eager / 30 graph steps of the
GPU time between CUDA events around the step's device work (eager: the model and the logits, the batch built
before; graphs: the whole step), the GPU held until the host has queued it all (`time_device`), so it does not
depend on the host's speed as the wall time does (lent machines' hosts differ). A step that waits for the GPU
inside (a host sync) is left out and counted ("synced" in the table).
Floor = bytes one step must read (the weights the step reads, as stored: the memory plan's storages,
`engine.memory.held_tensors`, that one step with the reference ops takes as inputs, so the fp32 router and
the fp32 MLA absorption weights count and the bf16 forms they replace do not; of the routed experts only
the MXFP4 bytes of the local experts the router actually picked in this step, of the embedding only the
batch's rows; the MLA latent cache, the KDA state read and written) / device copy bandwidth measured in the
same run. Graph memory: reserved bytes across building and capturing the graphs (cached blocks returned
first) beside what the memory plan sets aside for them (`engine.memory.graph_reserve_bytes`).

Order under --budget-s (wall seconds from start; what would start later is skipped and listed): eager and
graphs at every batch; the reference at --reference-batches; --profile; the reference at the other batches.
A reference row starts only when its --reference-cap-s fits in the budget, and stops timing once past that
cap (at least 1 timed step after 1 warm-up; the table shows how many). --profile: torch.profiler (CUDA
activity) over 6 graph steps at --profile-batches: kernels per step, busy vs span vs wall, op families,
top 15 kernels (`_kernel_profile.py`); if the replay shows no kernels, the eager step is profiled instead
and the profile says so. `--smoke` runs the script on the CPU with k3-tiny-gpu and small contexts (checks
the code, measures nothing; no graphs on a CPU: the graphs column stays empty, the padded step runs eagerly)."""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import math
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _kernel_profile import print_profile, profile_step  # noqa: E402
from k3serve.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from k3serve.engine.config import EngineArgs  # noqa: E402
from k3serve.engine.memory import graph_reserve_bytes, held_tensors, storage_bytes  # noqa: E402
from k3serve.engine.scheduler_output import ScheduledSeq  # noqa: E402
from k3serve.kernels import _backend, kda, mla, moe  # noqa: E402
from k3serve.kernels.mxfp4 import quantize_mxfp4  # noqa: E402
from k3serve.model.batch import ForwardBatch, ModelCache  # noqa: E402
from k3serve.model.config import ModelConfig  # noqa: E402
from k3serve.model.layers import mlp as mlp_mod  # noqa: E402
from k3serve.model.layers.mlp import RoutedExperts  # noqa: E402
from k3serve.model.model import KimiForCausalLM  # noqa: E402
from k3serve.model.parallel import TensorParallel  # noqa: E402
from k3serve.model.presets import K3_TINY, K3_TINY_GPU, preset_hf_config  # noqa: E402

BLOCK = 64


class LocalTP(TensorParallel):
    """Rank 0's shapes of a TP group, without the group: collectives are skipped (one rank's compute). The
    logits gather hands back this rank's shard in every rank's place (a view), so rank 0 still pays the copy
    that orders and widens the gathered logits."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        return x.unsqueeze(0).expand(self.world_size, *x.shape)


def rank_slice_hf(num_layers: int = 4) -> dict:
    """One TP8 rank of Kimi-K3 cut to its first `num_layers` layers, kept in K3's order (MLA at every 4th)."""
    hf = preset_hf_config("kimi-k3")
    text = hf["text_config"]
    lin = text["linear_attn_config"]
    if not 1 <= num_layers <= text["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{text['num_hidden_layers']}, got {num_layers}")
    text.update(num_hidden_layers=num_layers)  # the whole vocab: the rank holds its eighth (ParallelLMHead)
    lin.update(full_attn_layers=[i for i in lin["full_attn_layers"] if i <= num_layers],
               kda_layers=[i for i in lin["kda_layers"] if i <= num_layers])
    return hf


CONFIGS = {"k3-tiny-gpu": (K3_TINY_GPU, 1), "k3-rank-slice": (None, 8), "k3-tiny": (K3_TINY, 1)}


@torch.no_grad()
def build_model(hf: dict, tp_size: int, dev: torch.device, dtype: torch.dtype) -> KimiForCausalLM:
    config = ModelConfig.from_hf_dict(copy.deepcopy(hf))
    with torch.device(dev):
        model = KimiForCausalLM(config, LocalTP(0, tp_size), dtype)
    torch.manual_seed(0)
    for name, p in model.named_parameters():  # the scales of model/checkpoint.py's random init
        shape = p.shape
        if name.endswith("A_log"):
            p.copy_(torch.empty(shape, device=dev).uniform_(1, 16).log())
        elif name.endswith(("dt_bias", "e_score_correction_bias")):
            p.copy_(0.1 * torch.randn(shape, device=dev))
        elif name.endswith("conv1d.weight"):
            p.copy_(0.5 * torch.randn(shape, device=dev))
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(shape, device=dev))
        elif name.endswith("embed_tokens.weight"):
            p.copy_(torch.randn(shape, device=dev))
        else:
            p.copy_(torch.randn(shape, device=dev) / math.sqrt(shape[-1]))
    for mod in model.modules():
        if not isinstance(mod, RoutedExperts):
            continue
        for proj in RoutedExperts.PROJ_SHAPES:
            if mod.mxfp4:
                packed, scales = getattr(mod, f"{proj}_packed"), getattr(mod, f"{proj}_scale")
                E, out_f, in_f = packed.shape[0], packed.shape[1], packed.shape[2] * 2
                for e0 in range(0, E, 8):
                    e1 = min(E, e0 + 8)
                    q = quantize_mxfp4(torch.randn(e1 - e0, out_f, in_f, device=dev) / math.sqrt(in_f))
                    packed[e0:e1], scales[e0:e1] = q.packed, q.scales
            else:
                w = getattr(mod, f"{proj}_weight")
                w.copy_(torch.randn(w.shape, device=dev) / math.sqrt(w.shape[-1]))
    model.process_weights_after_loading()
    return model.eval()


def make_cache(model: KimiForCausalLM, tp_size: int, max_batch: int, ctx: int, dev, dtype) -> ModelCache:
    blocks_per_seq = -(-(ctx + 1) // BLOCK)
    cache = ModelCache.allocate(model.config, max_batch * blocks_per_seq + 1, max_batch, BLOCK, tp_size, dtype, dev,
                                reserve_pad_slot=True)
    for t in cache.mla_kv + cache.kda_conv:
        t.normal_()
    for t in cache.kda_recurrent:
        t.normal_(0.0, 0.05)
    return cache


def decode_seqs(model: KimiForCausalLM, n: int, ctx: int) -> list[ScheduledSeq]:
    """n sequences, each one token after ctx cached ones, in its own blocks and slot."""
    blocks_per_seq = -(-(ctx + 1) // BLOCK)
    vocab = model.config.vocab_size
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(n)]
    return [ScheduledSeq(f"r{i}", [(17 * i + 5) % vocab], ctx, tables[i], i, is_prefill=False, needs_sample=True)
            for i in range(n)]


def decode_step_parts(model: KimiForCausalLM, cache: ModelCache, n: int, ctx: int):
    """The eager step in two: `build()` (host lists -> device tensors, blocking copies) and `forward(batch)`
    (the model and the logits), so that the device time can leave out the host's part."""
    dev = next(model.parameters()).device
    seqs = decode_seqs(model, n, ctx)

    def build() -> ForwardBatch:
        return ForwardBatch.build([s.token_ids for s in seqs], [ctx] * n, [s.block_ids for s in seqs],
                                  [s.slot_id for s in seqs], BLOCK, device=dev)

    def forward(batch: ForwardBatch) -> torch.Tensor:
        return model.compute_logits(model(batch, cache))

    return build, forward


def decode_step_fn(model: KimiForCausalLM, cache: ModelCache, n: int, ctx: int):
    build, forward = decode_step_parts(model, cache, n, ctx)
    return lambda: forward(build())


def graph_step_fn(model: KimiForCausalLM, graphs: DecodeGraphs, n: int, ctx: int):
    seqs = decode_seqs(model, n, ctx)

    def step() -> torch.Tensor:
        return model.compute_logits(graphs.run(seqs))

    return step


def time_step(step, dev: torch.device, warmup: int, iters: int,
              cap_s: float | None = None) -> tuple[float, list[float]]:
    """Median wall ms of `iters` synchronized steps after `warmup`; with `cap_s`, timing stops once warm-up
    and timed steps together have taken that long (at least one step is timed)."""
    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    started = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    times: list[float] = []
    while len(times) < iters and (cap_s is None or not times or time.perf_counter() - started < cap_s):
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), times


@functools.cache
def sleep_cycles_per_ms() -> float:
    """Clock cycles `torch.cuda._sleep` spins per ms on this GPU (measured once; a hold's length needs no more
    than its order of magnitude)."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1 << 24)
    end.record()
    end.synchronize()
    return (1 << 24) / start.elapsed_time(end)


def time_device(run, iters: int, hold_ms: float, prepare=lambda: None) -> tuple[float | None, list[float], int]:
    """Median device ms of `run(prepare())` between CUDA events over `iters` steps (`prepare` untimed), the
    timed steps' ms, and how many steps the hold did not cover (left out of the median; None if all).

    Events alone would time the host: on an idle GPU the start event fires as soon as it is queued, and the
    GPU then waits for each launch. So the GPU is held (`torch.cuda._sleep`, `hold_ms`) until the host has
    queued the whole step; the events then time the GPU's work back to back, whatever the host's speed. A
    step that waits for the GPU inside (a host sync) finds the start event already fired: not covered."""
    cycles = int(hold_ms * sleep_cycles_per_ms())
    times, uncovered = [], 0
    for _ in range(iters):
        inputs = prepare()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        run(inputs)
        end.record()
        covered = not start.query()
        end.synchronize()
        if covered:
            times.append(start.elapsed_time(end))
        else:
            uncovered += 1
    return (statistics.median(times) if times else None), times, uncovered


def copy_bandwidth(dev: torch.device, smoke: bool) -> float:
    """Bytes read + written per second by a 1 GiB device copy (median of 10, after 3 warm-ups)."""
    n = (1 << 16) if smoke else (1 << 29)
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    if dev.type != "cuda":
        start = time.perf_counter()
        dst.copy_(src)
        return 4 * n / (time.perf_counter() - start)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 4 * n / statistics.median(times)


class _StorageReads(TorchDispatchMode):
    """Records which of `storages` (storage id -> bytes) the ops run under it take as inputs."""

    def __init__(self, storages: dict[int, int]) -> None:
        super().__init__()
        self.storages = storages
        self.read: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in self.storages:
                self.read.add(t.untyped_storage()._cdata)
        return func(*args, **(kwargs or {}))


def weights_read(model: KimiForCausalLM, step) -> dict[int, int]:
    """Storage id -> bytes of every weight one step reads: the model's storages as the memory plan counts
    them (`engine.memory.held_tensors`, derived forms such as the fp32 router included), kept where an op of
    the step takes them. The step runs with the torch reference ops forced, so that every kernel is an op
    the recorder sees (Triton launches are not); the layers hand both forms the same tensors."""
    recorder = _StorageReads(storage_bytes(held_tensors(model)))
    with _backend.reference_kernels(), recorder:
        step()
    return {k: recorder.storages[k] for k in recorder.read}


def step_bytes(model: KimiForCausalLM, cache: ModelCache, n: int, ctx: int, experts_hit: list[int],
               read: dict[int, int]) -> dict:
    """Bytes one decode step must move: the weights it reads (`weights_read`; routed experts: only those hit,
    the embedding: only the batch's rows), MLA cache, KDA state."""
    expert_bufs = {b.untyped_storage()._cdata for m in model.modules() if isinstance(m, RoutedExperts)
                   for b in m.buffers()}
    embed = model.model.embed_tokens.weight
    skipped = expert_bufs | {embed.untyped_storage()._cdata}
    dense = sum(nbytes for k, nbytes in read.items() if k not in skipped)
    dense += n * embed.shape[1] * embed.element_size()
    per_expert = 0
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            per_expert = sum(b[0].numel() * b.element_size() for b in m.buffers())
            break
    experts = sum(experts_hit) * per_expert
    mla_kv = sum(n * (ctx + 1) * kv.shape[-1] * kv.element_size() for kv in cache.mla_kv)
    kda_state = sum(2 * n * (s[0].numel() * s.element_size() + c[0].numel() * c.element_size())
                    for s, c in zip(cache.kda_recurrent, cache.kda_conv))
    return {"dense_weights": dense, "routed_experts": experts, "experts_hit_per_layer": experts_hit,
            "mla_kv": mla_kv, "kda_state": kda_state, "total": dense + experts + mla_kv + kda_state}


def experts_hit(step) -> list[int]:
    """Distinct local experts each MoE layer runs in one step (records the routing of a real step)."""
    hits: list[int] = []
    original = mlp_mod.fused_experts

    def recording(x, weights, topk_weights, topk_ids, activation, expert_start=0):
        local = topk_ids - expert_start
        local = local[(local >= 0) & (local < weights.w1.shape[0])]
        hits.append(int(local.unique().numel()))
        return original(x, weights, topk_weights, topk_ids, activation, expert_start)

    mlp_mod.fused_experts = recording
    try:
        step()
    finally:
        mlp_mod.fused_experts = original
    return hits


def backends() -> str:
    used = {**kda.last_backend, **mla.last_backend, **moe.last_backend}
    short = {"kda_decode": "kda", "mla_decode_paged": "mla", "fused_experts": "moe"}
    return " ".join(f"{short[k]}:{used.get(k, '-')}" for k in short)


class Budget:
    """Wall seconds from the start against --budget-s; what does not fit is listed, not silently dropped."""

    def __init__(self, seconds: float, skipped: list[str]) -> None:
        self.deadline = time.perf_counter() + seconds
        self.skipped = skipped

    def allows(self, what: str, need_s: float = 0.0) -> bool:
        if time.perf_counter() + need_s <= self.deadline:
            return True
        self.skipped.append(f"{what}: over --budget-s")
        return False


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON of rows and profiles, rewritten after each one")
    parser.add_argument("--configs", help="default k3-rank-slice (--smoke: k3-rank-slice,k3-tiny-gpu)")
    parser.add_argument("--layers", type=int, default=12, help="k3-rank-slice: K3's first LAYERS layers")
    parser.add_argument("--batches", help="default 1,2,4,8,16,32,64 (--smoke: 1,4)")
    parser.add_argument("--ctx", type=int, default=8192, help="cached tokens per sequence (--smoke: 128)")
    parser.add_argument("--reference-batches", help="reference first at these (of --batches); default 1,8,64 "
                        "(--smoke: 1)")
    parser.add_argument("--reference-cap-s", type=float, default=15.0, help="stop timing a reference row after this")
    parser.add_argument("--profile", action="store_true", help="profile graph replays at --profile-batches")
    parser.add_argument("--profile-batches", help="default 1,64 (--smoke: 1,4)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="skip what would start after this")
    parser.add_argument("--max-model-len", type=int, default=8192, help="graphs: block-table width in tokens")
    parser.add_argument("--moe-gemv-max-tokens", type=int, help="decode batches up to this run the MoE GEMV pair "
                        "(triton_moe.GEMV_MAX_TOKENS; an A/B knob), larger ones the tensor-core pair")
    parser.add_argument("--moe-mma-max-tokens", type=int, help="decode batches past the GEMV's up to this run the "
                        "Gluon MMA pair (triton_moe.MMA_MAX_TOKENS; an A/B knob)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    args.configs = (args.configs or ("k3-rank-slice,k3-tiny-gpu" if args.smoke else "k3-rank-slice")).split(",")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown --configs {unknown}; choose from {sorted(CONFIGS)}")
    defaults = {"batches": ("1,2,4,8,16,32,64", "1,4"), "reference_batches": ("1,8,64", "1"),
                "profile_batches": ("1,64", "1,4")}
    for name, (full, smoke) in defaults.items():
        values = [int(b) for b in (getattr(args, name) or (smoke if args.smoke else full)).split(",")]
        if any(b < 1 for b in values):
            parser.error(f"--{name.replace('_', '-')} must be positive integers, got {values}")
        setattr(args, name, sorted(set(values)))
    if args.smoke:
        args.ctx = 128
    return args


def graph_memory(dev: torch.device) -> int:
    """Device memory the caching allocator holds once its unused cached blocks are returned: the difference
    across capturing is what the graphs keep (inputs, output, their private pool)."""
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(dev)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def time_ours_and_graphs(cfg_name: str, model: KimiForCausalLM, cache: ModelCache, graphs: DecodeGraphs, n: int,
                         ctx: int, dev: torch.device, bw: float, smoke: bool, read: dict[int, int]) -> dict:
    """A row without its reference: ours eager, ours as a graph replay (when captured), bytes and floor."""
    build, forward = decode_step_parts(model, cache, n, ctx)
    step = decode_step_fn(model, cache, n, ctx)
    t0 = time.perf_counter()
    ours_ms, ours_all = time_step(step, dev, warmup=3, iters=3 if smoke else 15)
    used = backends()
    hits = experts_hit(step)
    first_s = time.perf_counter() - t0
    ours_device = graphs_device = (None, [], 0)  # a CPU has no device time
    if dev.type == "cuda":  # holding the GPU twice the wall step covers the step's queueing
        ours_device = time_device(forward, 15, 2 * ours_ms + 1, prepare=build)
    graphs_ms, graphs_all = None, []
    graph_step = graph_step_fn(model, graphs, n, ctx)
    if graphs.captured:
        before = graphs.num_replays
        graphs_ms, graphs_all = time_step(graph_step, dev, warmup=3, iters=30)
        if graphs.num_replays - before != 33:
            raise RuntimeError(f"{cfg_name} N{n}: the graph step replayed {graphs.num_replays - before} of 33 times")
        graphs_device = time_device(lambda _: graph_step(), 30, 2 * graphs_ms + 1)
    else:  # on a CPU nothing is captured: the padded body runs once, as a code check
        graph_step()
    moved = step_bytes(model, cache, n, ctx, hits, read)
    floor_ms = 1e3 * moved["total"] / bw
    return {"config": cfg_name, "layers": model.config.num_hidden_layers, "batch": n, "ctx": ctx,
            "ours_ms": ours_ms, "graphs_ms": graphs_ms, "reference_ms": None, "reference_steps": 0, "speedup": None,
            "graphs_speedup_vs_ours": None if graphs_ms is None else ours_ms / graphs_ms,
            "floor_ms": floor_ms, "ours_x_floor": ours_ms / floor_ms,
            "graphs_x_floor": None if graphs_ms is None else graphs_ms / floor_ms,
            "ours_backends": used, "reference_backends": None, "bytes": moved,
            "ours_times_ms": ours_all, "graphs_times_ms": graphs_all, "reference_times_ms": [],
            "ours_warmup_and_timing_s": first_s, "ours_device_ms": ours_device[0],
            "ours_device_times_ms": ours_device[1], "ours_device_uncovered": ours_device[2],
            "graphs_device_ms": graphs_device[0], "graphs_device_times_ms": graphs_device[1],
            "graphs_device_uncovered": graphs_device[2]}


def time_reference(row: dict, model: KimiForCausalLM, cache: ModelCache, dev: torch.device, iters: int,
                   cap_s: float) -> None:
    """Fill in the row's reference: the same eager step with `reference_kernels()`, timing capped at cap_s."""
    step = decode_step_fn(model, cache, row["batch"], row["ctx"])
    with _backend.reference_kernels():
        ref_ms, ref_all = time_step(step, dev, warmup=1, iters=iters, cap_s=cap_s)
        ref_used = backends()
    row.update(reference_ms=ref_ms, reference_steps=len(ref_all), reference_times_ms=ref_all,
               speedup=ref_ms / row["ours_ms"], reference_backends=ref_used, reference_cap_s=cap_s)
    print(f"{row['config']} N{row['batch']}: reference {ref_ms:.2f} ms (median of {len(ref_all)}; {ref_used})",
          flush=True)


def profile_row(row: dict, model: KimiForCausalLM, cache: ModelCache, graphs: DecodeGraphs,
                dev: torch.device) -> dict:
    """Kernels of the graph step (the eager step when the profiler cannot see inside the replays)."""
    n, ctx = row["batch"], row["ctx"]
    prof = profile_step(graph_step_fn(model, graphs, n, ctx), dev)
    if not graphs.captured:
        source = "padded step run eagerly (nothing captured on a CPU: --smoke checks the code only)"
    else:
        source = "graph replays"
        if prof.get("kernels_per_step", 0) < 10:  # a decode step is hundreds of kernels: the replay was not seen
            source = (f"eager step: the profiler saw {prof.get('kernels_per_step', 0):.0f} kernels per graph step, "
                      "not the kernels inside the replay")
            prof = profile_step(decode_step_fn(model, cache, n, ctx), dev)
    print(f"{row['config']} N{n}: profiled ({source})", flush=True)
    return {"config": row["config"], "batch": n, "ctx": ctx, "source": source, "floor_ms": row["floor_ms"],
            "graphs_ms": row["graphs_ms"], **prof}


def run_config(cfg_name: str, args: argparse.Namespace, dev: torch.device, bw: float, result: dict,
               budget: Budget, save) -> None:
    """Eager + graphs at every batch, then the reference, the profiles and the rest of the reference."""
    hf, tp_size = CONFIGS[cfg_name]
    hf = rank_slice_hf(args.layers) if hf is None else hf
    if args.smoke and cfg_name == "k3-rank-slice":
        cfg = ModelConfig.from_hf_dict(copy.deepcopy(hf))
        result["skipped"].append(f"{cfg_name}: not built in --smoke; its {cfg.num_hidden_layers} layers parse "
                                 f"(KDA {[i + 1 for i in cfg.kda_layers]}, MLA {[i + 1 for i in cfg.mla_layers]})")
        return
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    model = build_model(hf, tp_size, dev, dtype)
    cache = make_cache(model, tp_size, max(args.batches), args.ctx, dev, dtype)
    read = weights_read(model, decode_step_fn(model, cache, args.batches[0], args.ctx))
    info = {"layers": model.config.num_hidden_layers, "built_s": time.perf_counter() - t0,
            "weight_bytes": sum(storage_bytes(held_tensors(model)).values()), "weight_bytes_read": sum(read.values()),
            "cache_bytes": tensor_bytes(cache.mla_kv + cache.kda_conv + cache.kda_recurrent)}
    result["configs"][cfg_name] = info
    print(f"{cfg_name}: {info['layers']} layers built in {info['built_s']:.1f} s, weights "
          f"{info['weight_bytes'] / 1e9:.2f} GB ({info['weight_bytes_read'] / 1e9:.2f} GB read by a step, routed "
          f"experts all counted), caches {info['cache_bytes'] / 1e9:.1f} GB", flush=True)
    max_blocks = -(-max(args.max_model_len, args.ctx + 1) // BLOCK)
    t0, reserved = time.perf_counter(), graph_memory(dev)
    graphs = DecodeGraphs(model, cache, args.batches, max_blocks)
    if dev.type == "cuda":
        graphs.capture()
        info["graphs_capture_s"] = time.perf_counter() - t0
        info["graphs_bytes"] = graph_memory(dev) - reserved
        plan_args = EngineArgs(device="cuda", tensor_parallel_size=tp_size, block_size=BLOCK,
                               max_model_len=max_blocks * BLOCK, max_num_seqs=max(args.batches),
                               cuda_graph_batch_sizes=tuple(args.batches))
        info["graphs_bytes_planned"] = graph_reserve_bytes(model.config, plan_args)
        print(f"{cfg_name}: graphs for {graphs.captured} captured in {info['graphs_capture_s']:.1f} s, holding "
              f"{info['graphs_bytes'] / 2**20:.1f} MiB (the memory plan sets aside "
              f"{info['graphs_bytes_planned'] / 2**20:.1f} MiB)", flush=True)
    rows: dict[int, dict] = {}
    for n in args.batches:
        if budget.allows(f"{cfg_name} N{n} eager + graphs"):
            rows[n] = time_ours_and_graphs(cfg_name, model, cache, graphs, n, args.ctx, dev, bw, args.smoke, read)
            result["rows"].append(rows[n])
            save()
            r = rows[n]
            print(f"{cfg_name} N{n}: ours {r['ours_ms']:.2f} ms (device {ms(r['ours_device_ms'])}; "
                  f"{r['ours_backends']}), graphs {ms(r['graphs_ms'])} (device {ms(r['graphs_device_ms'])}), "
                  f"floor {r['floor_ms']:.3f} ms", flush=True)
    ref_iters = 3 if (args.smoke or cfg_name == "k3-rank-slice") else 7

    def references(batches: list[int]) -> None:
        for n in batches:
            if budget.allows(f"{cfg_name} N{n} reference", need_s=args.reference_cap_s):
                time_reference(rows[n], model, cache, dev, ref_iters, args.reference_cap_s)
                save()

    references([n for n in rows if n in args.reference_batches])
    if args.profile:
        for n in args.profile_batches:
            if n in rows and budget.allows(f"{cfg_name} N{n} profile"):
                result["profiles"].append(profile_row(rows[n], model, cache, graphs, dev))
                save()
    references([n for n in rows if n not in args.reference_batches])
    info["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    del model, cache, graphs
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def print_report(result: dict) -> None:
    print(f"\n### Decode step, eager and CUDA graphs ({result['device']}, {result['date']}; {result['ctx']} cached "
          f"tokens per sequence; copy {result['copy_bytes_per_s'] / 1e12:.2f} TB/s measured in this run)\n")
    cols = ["model", "layers", "batch", "ours ms", "ours device ms", "graphs ms", "graphs device ms",
            "reference ms (steps)", "speedup", "graphs vs ours",
            "floor ms", "ours x floor", "graphs x floor", "MB / step", "local experts hit / layer", "ours ran"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))

    def opt(value: float | None, fmt: str, unit: str = "") -> str:
        return "-" if value is None else format(value, fmt) + unit

    def device(r: dict, kind: str) -> str:  # steps the hold did not cover: they waited on the GPU inside
        left_out = r[f"{kind}_device_uncovered"]
        return opt(r[f"{kind}_device_ms"], ".2f") + (f" ({left_out} synced, left out)" if left_out else "")

    for r in result["rows"]:
        hits = r["bytes"]["experts_hit_per_layer"]
        hit_range = f"{min(hits)}-{max(hits)} (mean {statistics.mean(hits):.0f})" if hits else "-"
        ref = "-" if r["reference_ms"] is None else f"{r['reference_ms']:.2f} ({r['reference_steps']})"
        print(f"| {r['config']} | {r['layers']} | {r['batch']} | {r['ours_ms']:.2f} | {device(r, 'ours')} | "
              f"{opt(r['graphs_ms'], '.2f')} | {device(r, 'graphs')} | "
              f"{ref} | {opt(r['speedup'], '.1f', 'x')} | {opt(r['graphs_speedup_vs_ours'], '.1f', 'x')} | "
              f"{r['floor_ms']:.3f} | {r['ours_x_floor']:.1f} | {opt(r['graphs_x_floor'], '.1f')} | "
              f"{r['bytes']['total'] / 1e6:.0f} | {hit_range} | {r['ours_backends']} |")
    for s in result["skipped"]:
        print(f"skipped: {s}")
    for p in result["profiles"]:
        print_profile(f"{p['config']} batch {p['batch']}, {p['ctx']} cached tokens: {p['source']}", p, p["floor_ms"])


def main() -> None:
    args = parse_args()
    if args.moe_gemv_max_tokens is not None:
        from k3serve.kernels.moe import triton_moe

        triton_moe.GEMV_MAX_TOKENS = args.moe_gemv_max_tokens
        print(f"MoE GEMV pair up to {args.moe_gemv_max_tokens} tokens (--moe-gemv-max-tokens)")
    if args.moe_mma_max_tokens is not None:
        from k3serve.kernels.moe import triton_moe

        triton_moe.MMA_MAX_TOKENS = args.moe_mma_max_tokens
        print(f"MoE Gluon MMA pair up to {args.moe_mma_max_tokens} tokens (--moe-mma-max-tokens)")
    if torch.cuda.is_available():
        dev = torch.device("cuda")
    elif args.smoke:
        dev = torch.device("cpu")
    else:
        sys.exit("needs a CUDA device (or --smoke)")
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "date": str(datetime.date.today()), "torch": torch.__version__, "ctx": args.ctx,
              "graphs_max_model_len": args.max_model_len, "budget_s": args.budget_s,
              "reference_cap_s": args.reference_cap_s, "copy_bytes_per_s": None, "configs": {}, "rows": [],
              "profiles": [], "skipped": []}
    budget = Budget(args.budget_s, result["skipped"])

    def save() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    def stop(signum, _frame) -> None:  # `timeout` sends SIGTERM: keep what was measured
        raise SystemExit(f"stopped by signal {signum}: the results above are partial")

    signal.signal(signal.SIGTERM, stop)
    try:
        result["copy_bytes_per_s"] = copy_bandwidth(dev, args.smoke)
        for cfg_name in args.configs:
            run_config(cfg_name, args, dev, result["copy_bytes_per_s"], result, budget, save)
    finally:
        save()
        if result["copy_bytes_per_s"] is not None:
            print_report(result)


if __name__ == "__main__":
    main()
