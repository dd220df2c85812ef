"""Prefill TTFT of one 8K-token prompt through the k3-rank-slice model on one GPU: the KDA prefix checkpoint
taken in the same pass vs split at the checkpoint (two forward calls, the engine's "align" mode).

    python benchmarks/gpu_prefill.py [--tokens 8192] [--cuts engine,mid] [--reps 5] [--out gpu_prefill.json]
    python benchmarks/gpu_prefill.py --smoke      # CPU, k3-tiny, 256 tokens (checks the script)

Model: `k3-rank-slice` from benchmarks/gpu_engine.py (one rank of Kimi-K3 at TP8 / EP8, 4 layers: KDA +
dense MLP, KDA + MoE, KDA + MoE, MLA + MoE; random weights, MXFP4 experts; all-reduces skipped).
One measurement = `ForwardBatch.build` + forward + logits of the last token, CUDA events around it
(host time inside counts: TTFT), warm-up first, median. Methods, per checkpoint position p:

  in-pass   one forward over the prompt; the KDA kernels also write the state after p tokens into a
            second slot (`checkpoint_offsets`), the conv window is cut from the same pass
  split     forward(tokens[:p]), copy the slot (the checkpoint), forward(tokens[p:]) over the cached
            prefix: what prefix caching costs without in-pass checkpoints
  none      one forward, no checkpoint (what a checkpoint adds to in-pass)

p = "engine" is the scheduler's choice (the prompt's last block boundary below its end: 8128 of 8192),
"mid" = tokens/2 + 17 (mid-chunk, both halves large).
The in-pass checkpoint slot, the final state and the last-token logits are compared with split's (the
run stops, timing nothing more, if the checkpoint slots differ by more than GROSS).
Floor = max(FLOPs / bf16 matmul rate, weight bytes / copy bandwidth), both measured in this run; FLOPs
= every dense weight once per token + routed experts at the expected rows (tokens * top-k * local /
all experts) + causal MLA attention + chunked KDA (as benchmarks/gpu_kda.py counts it)."""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from _gpu_common import ceilings, device, device_name, parse_args, rel_err
from gpu_engine import BLOCK, CONFIGS, build_model, rank_slice_hf
from k3serve.kernels import kda, moe
from k3serve.model.batch import ForwardBatch, ModelCache
from k3serve.model.layers.mlp import RoutedExperts
from k3serve.model.model import KimiForCausalLM

GROSS = 0.1  # checkpoint slots (in-pass vs split) further apart than this (relative RMS): a bug, not bf16 rounding


def engine_cut(tokens: int) -> int:
    """The scheduler's prefix checkpoint: the last block boundary below the prompt's end."""
    return ((tokens - 1) // BLOCK) * BLOCK


class Prefill:
    """One prompt through the model: the three methods, each building its batches as the runner does."""

    def __init__(self, model: KimiForCausalLM, tp_size: int, tokens: int, dev: torch.device) -> None:
        self.model, self.dev = model, dev
        self.cache = ModelCache.allocate(model.config, -(-tokens // BLOCK) + 1, 2, BLOCK, tp_size, model.dtype, dev)
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=gen).tolist()
        self.blocks = list(range(-(-tokens // BLOCK)))

    def _forward(self, ids: list[int], computed: int, cut: int | None) -> torch.Tensor:
        ckpt = {} if cut is None else {"checkpoint_offsets": [cut], "checkpoint_slot_ids": [1]}
        if computed == 0:  # a fresh sequence starts from zero state, as the runner sees to
            self.cache.zero_slots([0])
        batch = ForwardBatch.build([ids], [computed], [self.blocks], [0], BLOCK, device=self.dev, **ckpt)
        hidden = self.model(batch, self.cache)
        return self.model.compute_logits(hidden[-1:])

    def in_pass(self, cut: int | None) -> torch.Tensor:
        return self._forward(self.ids, 0, cut)

    def split(self, cut: int) -> torch.Tensor:
        self._forward(self.ids[:cut], 0, None)
        self.cache.copy_slot(0, 1)
        return self._forward(self.ids[cut:], cut, None)

    def states(self) -> dict[str, torch.Tensor]:
        """Slot 0 (after the prompt) and slot 1 (the checkpoint), every KDA layer, recurrent + conv."""
        c = self.cache
        return {f"{kind} slot {s}": torch.stack([t[s].float() for t in pools])
                for kind, pools in (("recurrent", c.kda_recurrent), ("conv", c.kda_conv)) for s in (0, 1)}


def event_ms(fn, dev: torch.device, warmup: int, reps: int) -> list[float]:
    """ms per call: CUDA events around fn (host work inside included), or wall clock on the CPU."""
    times = []
    for i in range(warmup + reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return times


def prefill_cost(model: KimiForCausalLM, tokens: int) -> dict[str, float]:
    """FLOPs and weight bytes of one prefill of `tokens` tokens (one rank; see the module docstring)."""
    cfg = model.config
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    matrices = [p for p in model.parameters() if p.dim() == 2 and p is not embed and p is not lm_head]
    dense_flops = 2 * tokens * sum(p.numel() for p in matrices) + 2 * lm_head.numel()  # logits: last token only
    routed = 0
    for m in experts:
        dim, inter = cfg.routed_expert_hidden_size or cfg.hidden_size, cfg.moe_intermediate_size
        rows = tokens * cfg.num_experts_per_token * m.num_local / cfg.num_experts
        routed += rows * 2 * 3 * dim * inter
    h_mla = cfg.num_attention_heads // model.tp.world_size
    mla = len(cfg.mla_layers) * h_mla * tokens * (tokens + 1) / 2 * 2 * (
        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    h_kda, d, C = cfg.kda.num_heads // model.tp.world_size, cfg.kda.head_dim, 64
    kda_flops = len(cfg.kda_layers) * tokens * h_kda * (10 * C * d + 6 * d * d)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    weight_bytes += sum(b.numel() * b.element_size() for m in experts for b in m.buffers())
    return {"flops": dense_flops + routed + mla + kda_flops, "dense_flops": dense_flops, "routed_flops": routed,
            "mla_attention_flops": mla, "kda_flops": kda_flops, "weight_bytes": weight_bytes}


def compare(prefill: Prefill, cut: int) -> dict[str, float]:
    """Relative RMS of in-pass vs split: the checkpoint slot, the final slot, the last-token logits."""
    logits_in = prefill.in_pass(cut)
    states_in = prefill.states()
    logits_split = prefill.split(cut)
    states_split = prefill.states()
    errs = {name: rel_err(states_split[name], states_in[name]) for name in states_in}
    errs["logits"] = rel_err(logits_split, logits_in)
    return errs


def main() -> None:
    def options(parser) -> None:
        parser.add_argument("--tokens", type=int, default=8192)
        parser.add_argument("--cuts", default="engine,mid",
                            help="checkpoint positions: numbers, 'engine' (the scheduler's), 'mid' (tokens/2 + 17)")
        parser.add_argument("--reps", type=int, default=5)
        parser.add_argument("--warmup", type=int, default=2)

    args = parse_args(__doc__, options)
    dev = device(args.smoke)
    cfg_name, tokens = ("k3-tiny", 256) if args.smoke else ("k3-rank-slice", args.tokens)
    hf, tp_size = CONFIGS[cfg_name]
    hf = rank_slice_hf() if hf is None else hf
    ceil = ceilings(dev, args.smoke)
    t0 = time.perf_counter()
    model = build_model(hf, tp_size, dev, torch.bfloat16)
    prefill = Prefill(model, tp_size, tokens, dev)
    cost = prefill_cost(model, tokens)
    floor_ms = 1e3 * max(cost["flops"] / ceil["bf16_flop_per_s"], cost["weight_bytes"] / ceil["copy_bytes_per_s"])
    result = {"device": device_name(dev), "model": cfg_name, "tokens": tokens, "ceilings": ceil, "cost": cost,
              "floor_ms": floor_ms, "build_s": time.perf_counter() - t0, "rows": [], "consistency": {}}
    print(f"{cfg_name}: built in {result['build_s']:.1f} s; {cost['flops'] / 1e12:.2f} TFLOP, weights "
          f"{cost['weight_bytes'] / 1e9:.2f} GB -> floor {floor_ms:.2f} ms", file=sys.stderr, flush=True)

    def save() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))

    def measure(method: str, cut: int | None, fn) -> None:
        times = event_ms(fn, dev, args.warmup, args.reps)
        med = statistics.median(times)
        result["rows"].append({"method": method, "cut": cut, "median_ms": med, "times_ms": times,
                               "x_floor": med / floor_ms, "kda": kda.last_backend.get("chunk_kda", "-"),
                               "moe": moe.last_backend.get("fused_experts", "-")})
        print(result["rows"][-1], file=sys.stderr, flush=True)
        save()

    measure("none", None, lambda: prefill.in_pass(None))
    for spec in args.cuts.split(","):
        cut = {"engine": engine_cut(tokens), "mid": tokens // 2 + 17}.get(spec) or int(spec)
        if not 0 < cut < tokens:
            sys.exit(f"checkpoint position {cut} outside the prompt (1..{tokens - 1})")
        errs = compare(prefill, cut)
        result["consistency"][str(cut)] = errs
        if max(v for k, v in errs.items() if k.endswith("slot 1")) > GROSS:
            save()
            sys.exit(f"the in-pass checkpoint differs from split's at p={cut}: {errs}")
        measure("in-pass", cut, lambda: prefill.in_pass(cut))
        measure("split", cut, lambda: prefill.split(cut))
    report(result)
    save()


def report(result: dict) -> None:
    rows = result["rows"]
    none = next(r for r in rows if r["method"] == "none")
    print(f"\n### Prefill TTFT, {result['model']}, {result['tokens']} tokens ({result['device']}; bf16 matmul "
          f"{result['ceilings']['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s, copy "
          f"{result['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s measured in this run; floor "
          f"{result['floor_ms']:.2f} ms)\n")
    print("| method | checkpoint at | median ms | vs no checkpoint | split / in-pass | x floor | kda | moe |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        pair = [x for x in rows if x["cut"] == r["cut"] and x["method"] in ("in-pass", "split")]
        ratio = "-" if len(pair) != 2 else f"{pair[1]['median_ms'] / pair[0]['median_ms']:.2f}x"
        print(f"| {r['method']} | {r['cut'] if r['cut'] is not None else '-'} | {r['median_ms']:.2f} | "
              f"{100 * (r['median_ms'] / none['median_ms'] - 1):+.1f}% | {ratio if r['method'] == 'split' else '-'} | "
              f"{r['x_floor']:.1f} | {r['kda']} | {r['moe']} |")
    for cut, errs in result["consistency"].items():
        print(f"in-pass vs split at {cut} (relative RMS): " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))


if __name__ == "__main__":
    main()
