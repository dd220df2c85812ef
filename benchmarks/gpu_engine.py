"""One decode step of the engine's model on one GPU: ours eager (the GPU kernels), ours replayed as a CUDA
graph (`engine/cuda_graphs.py`, the engine's default on CUDA), and the same model and caches with the torch
reference ops forced (`reference_kernels()`), batch 1 / 8 / 32 at 2K context.

    python benchmarks/gpu_engine.py [--out gpu_engine.json] [--configs k3-tiny-gpu,k3-rank-slice]
                                    [--budget-s 150] [--max-model-len 8192] [--smoke]

Models (random weights generated in memory on the GPU: model construction, then a random init of every
parameter; routed experts through `quantize_mxfp4`; no checkpoint is written):

  k3-tiny-gpu     `model.presets.K3_TINY_GPU`: 7 layers, hidden 256, KDA 12 x 128, MLA latent 512 + 64,
                  8 MXFP4 experts of 128 x 128 (the GPU engine tests' model).
  k3-rank-slice   one rank of Kimi-K3 at TP8 / EP8, 4 layers in K3's order (0: KDA + dense MLP, 1-2: KDA +
                  MoE, 3: MLA + MoE): KDA 12 of 96 heads, MLA 12 of 96 heads, dense MLP 4224 of 33792,
                  112 local of 896 MXFP4 experts (latent 3584, intermediate 3072, top-16), shared experts
                  768 of 6144, hidden 7168; the vocabulary is one TP8 shard (20480 of 163840) standing in for
                  a vocab-parallel lm_head. All-reduces are no-ops: this times one rank's compute.

Step = `ForwardBatch.build` (host lists -> device tensors) + `model(batch, cache)` + `compute_logits`,
synchronized, wall clock, median; the caches hold 2048 random tokens per sequence (MLA blocks and KDA
state), the step appends the 2049th. Graphs: `DecodeGraphs` captured for the batch sizes 1 / 8 / 32 (no
padding), block tables as wide as --max-model-len (as in the engine), step = `DecodeGraphs.run` (inputs
into the static buffers + replay) + `compute_logits`; capture time (warm-up + record, all sizes) reported.
Floor = bytes one step must read (every weight except the routed experts, plus the MXFP4 bytes of the
local experts the router actually picked in this step, the MLA latent cache, the KDA state read and
written) / device copy bandwidth measured in the same run.
`--smoke` runs the script on the CPU with small contexts (checks the code, measures nothing; no graphs
on a CPU: the graphs column stays empty)."""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3serve.engine.cuda_graphs import DecodeGraphs  # noqa: E402
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
    """Rank 0's shapes of a TP group, without the group: all-reduces are skipped (one rank's compute)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def rank_slice_hf() -> dict:
    hf = preset_hf_config("kimi-k3")
    text = hf["text_config"]
    text.update(num_hidden_layers=4, vocab_size=163840 // 8)
    text["linear_attn_config"].update(full_attn_layers=[4], kda_layers=[1, 2, 3])
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


def decode_step_fn(model: KimiForCausalLM, cache: ModelCache, n: int, ctx: int):
    dev = next(model.parameters()).device
    seqs = decode_seqs(model, n, ctx)

    def step() -> torch.Tensor:
        batch = ForwardBatch.build([s.token_ids for s in seqs], [ctx] * n, [s.block_ids for s in seqs],
                                   [s.slot_id for s in seqs], BLOCK, device=dev)
        return model.compute_logits(model(batch, cache))

    return step


def graph_step_fn(model: KimiForCausalLM, graphs: DecodeGraphs, n: int, ctx: int):
    seqs = decode_seqs(model, n, ctx)

    def step() -> torch.Tensor:
        return model.compute_logits(graphs.run(seqs))

    return step


def time_step(step, dev: torch.device, warmup: int, iters: int) -> tuple[float, list[float]]:
    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), times


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


def step_bytes(model: KimiForCausalLM, cache: ModelCache, n: int, ctx: int, experts_hit: list[int]) -> dict:
    """Bytes one decode step must move: weights (routed experts: only those hit), MLA cache, KDA state."""
    cfg = model.config
    expert_bufs = {id(b) for m in model.modules() if isinstance(m, RoutedExperts) for b in m.buffers()}
    embed = model.model.embed_tokens.weight
    dense = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
                if id(t) not in expert_bufs and t is not embed)
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


def profile_step(step, dev: torch.device, steps: int = 3, top: int = 15) -> dict:
    """Where an eager step's time goes: torch.profiler over `steps` steps, per step. GPU busy = the sum of
    the device time of every kernel and copy (overlap ignored)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events if e.device_type.name == "CUDA")
    by_cpu = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)

    def count(*names: str) -> float:
        return sum(e.count for e in events if e.key in names) / steps

    return {
        "gpu_busy_ms_per_step": device_us / 1e3 / steps,
        "kernel_launches_per_step": count("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                          "cudaLaunchKernelExC"),
        "syncs_per_step": count("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
        "aten_ops_per_step": sum(e.count for e in events if e.key.startswith("aten::")) / steps,
        "top_self_cpu_us_per_step": [(e.key, round(e.self_cpu_time_total / steps), e.count // steps)
                                     for e in by_cpu[:top]],
    }


def backends() -> str:
    used = {**kda.last_backend, **mla.last_backend, **moe.last_backend}
    short = {"kda_decode": "kda", "mla_decode_paged": "mla", "fused_experts": "moe"}
    return " ".join(f"{short[k]}:{used.get(k, '-')}" for k in short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--configs", default="k3-tiny-gpu,k3-rank-slice")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip what would start after this")
    parser.add_argument("--max-model-len", type=int, default=8192, help="graphs: block-table width in tokens")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--profile", action="store_true", help="time nothing; profile one eager step of ours per row")
    args = parser.parse_args()
    started = time.perf_counter()
    if torch.cuda.is_available():
        dev = torch.device("cuda")
    elif args.smoke:
        dev = torch.device("cpu")
    else:
        sys.exit("needs a CUDA device (or --smoke)")
    dtype = torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    ctx = 128 if args.smoke else args.ctx
    bw = copy_bandwidth(dev, args.smoke)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    result = {"device": name, "date": str(datetime.date.today()), "torch": torch.__version__, "ctx": ctx,
              "graphs_max_model_len": args.max_model_len, "copy_bytes_per_s": bw, "rows": [], "skipped": []}

    def save() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    for cfg_name in args.configs.split(","):
        hf, tp_size = CONFIGS[cfg_name]
        hf = rank_slice_hf() if hf is None else hf
        if args.smoke and cfg_name == "k3-rank-slice":
            result["skipped"].append(f"{cfg_name}: not in --smoke")
            continue
        t0 = time.perf_counter()
        model = build_model(hf, tp_size, dev, dtype)
        cache = make_cache(model, tp_size, max(batches), ctx, dev, dtype)
        print(f"{cfg_name}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        graphs, capture_s = None, None
        if not args.profile:  # on a CPU (--smoke) nothing is captured: the padded body runs once, as a code check
            t0 = time.perf_counter()
            graphs = DecodeGraphs(model, cache, sorted(batches), -(-max(args.max_model_len, ctx + 1) // BLOCK))
            if dev.type == "cuda":
                graphs.capture()
                capture_s = time.perf_counter() - t0
                print(f"{cfg_name}: graphs for {graphs.captured} captured in {capture_s:.1f} s", flush=True)
        for n in batches:
            if time.perf_counter() - started > args.budget_s:
                result["skipped"].append(f"{cfg_name} N{n}: over --budget-s")
                continue
            step = decode_step_fn(model, cache, n, ctx)
            if args.profile:
                for _ in range(3):
                    step()
                prof = {"config": cfg_name, "batch": n, "ours_backends": backends(), **profile_step(step, dev)}
                result.setdefault("profiles", []).append(prof)
                save()
                print(json.dumps(prof), flush=True)
                continue
            t0 = time.perf_counter()
            ours_ms, ours_all = time_step(step, dev, warmup=3, iters=3 if args.smoke else 15)
            used = backends()
            hits = experts_hit(step)
            first_ms = time.perf_counter() - t0
            big = cfg_name == "k3-rank-slice"
            with _backend.reference_kernels():
                ref_ms, ref_all = time_step(step, dev, warmup=1, iters=3 if (args.smoke or big) else 7)
                ref_used = backends()
            graphs_ms, graphs_all = None, []
            if graphs is not None and graphs.captured:
                before = graphs.num_replays
                graphs_ms, graphs_all = time_step(graph_step_fn(model, graphs, n, ctx), dev, warmup=3, iters=30)
                assert graphs.num_replays - before == 33, "the graph step did not replay"
            elif graphs is not None:
                graph_step_fn(model, graphs, n, ctx)()
            moved = step_bytes(model, cache, n, ctx, hits)
            floor_ms = 1e3 * moved["total"] / bw
            row = {"config": cfg_name, "batch": n, "ctx": ctx, "ours_ms": ours_ms, "graphs_ms": graphs_ms,
                   "reference_ms": ref_ms, "speedup": ref_ms / ours_ms,
                   "graphs_speedup_vs_ours": None if graphs_ms is None else ours_ms / graphs_ms,
                   "floor_ms": floor_ms, "ours_x_floor": ours_ms / floor_ms,
                   "graphs_x_floor": None if graphs_ms is None else graphs_ms / floor_ms,
                   "ours_backends": used, "reference_backends": ref_used, "bytes": moved,
                   "ours_times_ms": ours_all, "graphs_times_ms": graphs_all, "reference_times_ms": ref_all,
                   "ours_warmup_and_timing_s": first_ms, "graphs_capture_s": capture_s}
            result["rows"].append(row)
            save()
            shown = "-" if graphs_ms is None else f"{graphs_ms:.2f} ms"
            print(f"{cfg_name} N{n}: ours {ours_ms:.2f} ms ({used}), graphs {shown}, reference {ref_ms:.2f} ms "
                  f"({ref_used}), floor {floor_ms:.3f} ms", flush=True)
        del model, cache, graphs
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\n### Decode step, eager and CUDA graphs ({name}, {result['date']}; {ctx} cached tokens per sequence; "
          f"copy {bw / 1e12:.2f} TB/s measured in this run)\n")
    cols = ["model", "batch", "ours ms", "graphs ms", "reference ms", "speedup", "graphs vs ours", "floor ms",
            "ours x floor", "graphs x floor", "MB / step", "local experts hit / layer", "ours ran"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))

    def opt(value: float | None, fmt: str, unit: str = "") -> str:
        return "-" if value is None else format(value, fmt) + unit

    for r in result["rows"]:
        print(f"| {r['config']} | {r['batch']} | {r['ours_ms']:.2f} | {opt(r['graphs_ms'], '.2f')} | "
              f"{r['reference_ms']:.2f} | {r['speedup']:.1f}x | {opt(r['graphs_speedup_vs_ours'], '.1f', 'x')} | "
              f"{r['floor_ms']:.3f} | {r['ours_x_floor']:.0f} | {opt(r['graphs_x_floor'], '.0f')} | "
              f"{r['bytes']['total'] / 1e6:.0f} | {','.join(map(str, r['bytes']['experts_hit_per_layer']))} | "
              f"{r['ours_backends']} |")
    for s in result["skipped"]:
        print(f"skipped: {s}")
    save()


if __name__ == "__main__":
    main()
