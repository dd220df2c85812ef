"""KDA on the GPU: prefill with in-pass checkpoints (8K tokens; 12 heads = one K3 rank at TP8, 96 = K3
whole, 32) and pooled decode (batch 1-64), ours vs fla.

    python benchmarks/gpu_kda.py [--out gpu_kda.json] [--heads 12,96,32] [--decode-heads 12,32]
                                 [--ops prefill,decode] [--smoke]

Prefill, per head count, one sequence of T tokens with an fp32 initial state, a checkpoint mid-chunk
at T/2 + 17 (times in us, median of CUDA-event timings, each measured twice interleaved, best kept):
  fla           fla's public chunk_kda, no checkpoint (its chunk indices cached on the device: fla at
                its best; the anchor a checkpoint must not slow down by more than 2%)
  ours          k3serve chunk_kda, no checkpoint, cu_seqlens on the host (no device sync)
  ours+ckpt     the same pass also returning the checkpoint (host cu_seqlens and offsets: no sync)
  ours+ckpt dev the same with cu_seqlens / offsets on the device (the public entry reads them back:
                what the engine pays while ForwardBatch keeps only device copies)
  fla split     two fla calls split at the checkpoint (the checkpoint is the first call's final
                state): what a checkpoint costs without in-pass support; ours+ckpt should be >= 10% faster
Floor = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured in this run. Every timed
call is first checked against the fp32 torch reference (naive.py); `resume` rows give how far the
second half, resumed from our checkpoint, lands from the unsplit fp32 reference, next to the
unsplit kernel's own error. Decode: kda_decode on a slot pool vs fla fused_recurrent_kda."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from _gpu_common import (ceilings, check, check_finite, device, device_name, floor_us, graph_launch_note,
                         graph_launch_us, graph_ms, graph_us, in_graph_us, l2_copies, parse_args, print_table, rel_err,
                         time_ms, x_floor)
from k3serve.kernels import kda
from k3serve.kernels.kda import chunk_kda, kda_decode, kda_gate, naive

K = V = 128
LB = -5.0
TOL = 1e-2
PREFILL_REP_MS = 300


def kda_inputs(T: int, H: int, dev):
    """bf16 q, k, v; the K3 bounded gate g in (LB, 0) fp32; beta in (0, 1): one sequence of T tokens."""
    q, k, v = (torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16) for _ in range(3))
    f = torch.randn(1, T, H, K, device=dev)
    A_log, dt_bias = torch.rand(H, device=dev) * 2 - 1, torch.randn(H * K, device=dev)
    beta = torch.rand(1, T, H, device=dev)
    return q, k, v, kda_gate(f, A_log, dt_bias, LB), beta


def best_of_interleaved(fns: dict, dev, rounds: int = 2) -> dict[str, float]:
    """us per call: each fn timed `rounds` times, in turn, the best median kept (a 2% question needs
    both sides measured under the same clocks and neighbours)."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            us = time_ms(fn, dev, PREFILL_REP_MS) * 1e3
            best[name] = min(us, best.get(name, us))
    return best


def fla_calls(inputs: tuple, h0: torch.Tensor, cut: int) -> tuple[Callable[[], tuple], Callable[[], tuple]]:
    """fla's public chunk_kda over one sequence (q, k, v, g, beta; fp32 initial state h0; the K3 bounded
    gate), and the same split at `cut` into two calls, the second resumed from the first's final state
    (returns o_head, o_rest, final, state_at_cut). cu_seqlens live on the device, made once here: fla
    caches its chunk indices by tensor identity, so these are fla at its best."""
    from fla.ops.kda import chunk_kda as fla_chunk

    T, dev = inputs[0].shape[1], h0.device
    fla_args = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=LB)
    cu, cu_head, cu_rest = (torch.tensor(c, device=dev) for c in ([0, T], [0, cut], [0, T - cut]))

    def whole() -> tuple:
        return fla_chunk(*inputs, initial_state=h0, cu_seqlens=cu, **fla_args)

    def split() -> tuple:
        o_head, state = fla_chunk(*(t[:, :cut] for t in inputs), initial_state=h0, cu_seqlens=cu_head, **fla_args)
        o_rest, final = fla_chunk(*(t[:, cut:] for t in inputs), initial_state=state, cu_seqlens=cu_rest, **fla_args)
        return o_head, o_rest, final, state

    return whole, split


def prefill_row(T: int, H: int, dev, ceil) -> tuple[dict, dict]:
    q, k, v, g, beta = kda_inputs(T, H, dev)
    h0 = torch.randn(1, H, K, V, device=dev)
    cut = T // 2 + 17  # a checkpoint in the middle of a chunk
    host_cu, host_off = torch.tensor([0, T]), torch.tensor([cut])
    dev_cu, dev_off = host_cu.to(dev), host_off.to(dev)
    common = dict(use_qk_l2norm_in_kernel=True, gate_lower_bound=LB)

    def ours(cu, off):
        return chunk_kda(q, k, v, g, beta, None, h0, cu, off, **common)

    o, final, cp = ours(host_cu, host_off)
    backend = kda.last_backend["chunk_kda"]
    ref_o, ref_final, ref_cp = naive.chunk_kda(q, k, v, g, beta, None, h0, dev_cu, dev_off, True)
    err = max(rel_err(ref_o, o), rel_err(ref_final, final), rel_err(ref_cp, cp))
    check(f"chunk_kda H{H}", err, TOL)
    rest = [t[:, cut:] for t in (q, k, v, g, beta)]
    o_resumed, final_resumed, _ = chunk_kda(*rest, None, cp, torch.tensor([0, T - cut]), **common)
    resume = {"H": H, "checkpoint_at": cut,
              "o_err_unsplit": rel_err(ref_o[:, cut:], o[:, cut:]), "o_err_resumed": rel_err(ref_o[:, cut:], o_resumed),
              "final_err_unsplit": rel_err(ref_final, final), "final_err_resumed": rel_err(ref_final, final_resumed),
              "checkpoint_err": rel_err(ref_cp, cp)}

    fns = {"ours": lambda: ours(host_cu, None), "ours_ckpt": lambda: ours(host_cu, host_off),
           "ours_ckpt_dev": lambda: ours(dev_cu, dev_off)}
    if dev.type == "cuda":
        fla_plain, fla_split = fla_calls((q, k, v, g, beta), h0, cut)
        check("fla chunk_kda", rel_err(ref_o, fla_plain()[0]), TOL)
        check("fla split", rel_err(ref_final, fla_split()[2]), TOL)
        fns = {"fla": fla_plain, **fns, "fla_split": fla_split}
    us = best_of_interleaved(fns, dev)

    bytes_moved = T * H * (3 * K * 2 + K * 4 + 4 + V * 2) + 2 * H * K * V * 4
    C = 64
    flops = T * H * (6 * C * K + 4 * C * V + 6 * K * V)
    floor = floor_us(bytes_moved, flops, ceil)
    row = dict(shape=f"T{T} H{H}", ckpt_at=cut, fla=us.get("fla"), ours=us["ours"], ours_ckpt=us["ours_ckpt"],
               ours_ckpt_dev=us["ours_ckpt_dev"], fla_split=us.get("fla_split"), floor=floor,
               x_floor=f"{us['ours_ckpt'] / floor:.1f}", err=f"{err:.1e}", backend=backend)
    row["ckpt_vs_fla"] = "-" if row["fla"] is None else f"{100 * (row['ours_ckpt'] / row['fla'] - 1):+.1f}%"
    row["ckpt_vs_ours"] = f"{100 * (row['ours_ckpt'] / row['ours'] - 1):+.1f}%"
    row["split_over_ckpt"] = "-" if row["fla_split"] is None else f"{row['fla_split'] / row['ours_ckpt']:.2f}x"
    return row, resume


def decode_row(N: int, H: int, dev, ceil) -> dict:
    """ours = kda_decode (our Triton step) on q/k/v views of one projection, as the layer passes them; the
    anchor is fla's fused_recurrent_kda_fwd on the same pool (what kda_decode ran before: contiguous copies
    of q, k, v, g, beta, then fla's kernel); `sweep` times our tile choices in one-call graphs."""
    copies = l2_copies(N * H * K * V * 4, dev)
    num_slots = (copies + 1) * N + 3  # each copy's N slots and spares that no call touches
    pool = torch.randn(num_slots, H, K, V, device=dev)
    slot_sets = torch.randperm(num_slots, device=dev)[: copies * N].reshape(copies, N)
    slots = slot_sets[0]
    _, _, _, g, beta, *_ = (t[0] if t.dim() > 1 else t for t in kda_inputs(N, H, dev))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    proj = torch.randn(N, H * (2 * K + V), device=dev, dtype=dtype)
    q, k, v = (t.reshape(N, H, -1) for t in proj.split([H * K, H * K, H * V], dim=-1))
    ref_pool = pool.clone()
    o = kda_decode(q, k, v, g, beta, pool, slots, use_qk_l2norm_in_kernel=True)
    backend = kda.last_backend["kda_decode"]
    ref_o = naive.kda_decode(q, k, v, g, beta, ref_pool, slots, None, True)
    err = max(rel_err(ref_o, o), rel_err(ref_pool[slots], pool[slots]))
    check(f"kda_decode N{N} H{H}", err, TOL)
    del ref_pool

    def ours(s: torch.Tensor = slots) -> torch.Tensor:
        return kda_decode(q, k, v, g, beta, pool, s, use_qk_l2norm_in_kernel=True)

    bytes_moved = 2 * N * H * K * V * 4 + N * H * (3 * K * 2 + K * 4 + 4 + V * 2)
    row = dict(op="decode", shape=f"N{N} H{H}", ours=time_ms(ours, dev) * 1e3, graph_1call=graph_us(ours, dev),
               in_graph=in_graph_us([lambda s=s: ours(s) for s in slot_sets], dev), anchor=None,
               anchor_graph_1call=None, anchor_in_graph=None, anchor_is="",
               floor=floor_us(bytes_moved, 4 * N * H * K * V, ceil), copies=copies, err=f"{err:.1e}",
               backend=backend, best="-")
    check_finite(f"kda_decode N{N} H{H}", ours(), pool)
    if dev.type == "cuda":
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        from k3serve.kernels.kda import triton_decode

        def fla_decode(s: torch.Tensor = slots) -> tuple:
            return fused_recurrent_kda_fwd(
                q=q.unsqueeze(1).contiguous(), k=k.unsqueeze(1).contiguous(), v=v.unsqueeze(1).contiguous(),
                g=g.unsqueeze(1).contiguous(), beta=beta.unsqueeze(1).contiguous(), initial_state=pool,
                inplace_final_state=True, ssm_state_indices=s, use_qk_l2norm_in_kernel=True)

        row.update(anchor=time_ms(fla_decode, dev) * 1e3, anchor_graph_1call=graph_us(fla_decode, dev),
                   anchor_in_graph=in_graph_us([lambda s=s: fla_decode(s) for s in slot_sets], dev),
                   anchor_is="fla fused_recurrent_kda_fwd on the pool")
        check_finite(f"fla decode N{N} H{H}", fla_decode()[0], pool)
        sweep = {}
        for bv in (8, 16, 32, 64):
            for warps in (1, 2, 4, 8):
                fn = lambda: triton_decode.kda_decode(q, k, v, g, beta, pool, slots, None, True,  # noqa: E731
                                                      block_v=bv, num_warps=warps)
                ms = graph_ms(fn, dev)
                sweep[f"BV{bv}w{warps}"] = None if ms is None else round(ms * 1e3, 2)
        row["sweep"] = sweep
        row["best"] = min((t, c) for c, t in sweep.items() if t is not None)[1]
    return row


def main() -> None:
    def options(parser) -> None:
        parser.add_argument("--heads", default="12,96,32", help="KDA head counts of the prefill rows")
        parser.add_argument("--decode-heads", default="12,32", help="KDA head counts of the decode rows")
        parser.add_argument("--ops", default="prefill,decode", help="which of prefill, decode to run")

    args = parse_args(__doc__, options)
    dev = device(args.smoke)
    torch.manual_seed(0)
    ceil = ceilings(dev, args.smoke)
    T, batches = (130, [1, 3]) if args.smoke else (8192, [1, 4, 16, 64])
    heads = [2] if args.smoke else [int(h) for h in args.heads.split(",")]
    decode_heads = [2] if args.smoke else [int(h) for h in args.decode_heads.split(",")]
    ops = args.ops.split(",")
    result = {"device": device_name(dev), "ceilings": ceil, "prefill": [], "resume": [], "decode": []}

    def save() -> None:  # after every row: a time limit that cuts the run keeps what was measured
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))

    for H in heads if "prefill" in ops else []:
        row, resume = prefill_row(T, H, dev, ceil)
        result["prefill"].append(row)
        result["resume"].append(resume)
        print(row, resume, file=sys.stderr, flush=True)
        save()
    for H in decode_heads if "decode" in ops else []:
        for N in batches:
            result["decode"].append(decode_row(N, H, dev, ceil))
            print(result["decode"][-1], file=sys.stderr, flush=True)
            save()
    if result["prefill"]:
        columns = ["shape", "ckpt_at", "fla", "ours", "ours_ckpt", "ours_ckpt_dev", "fla_split", "ckpt_vs_fla",
                   "ckpt_vs_ours", "split_over_ckpt", "floor", "x_floor", "err", "backend"]
        print_table("KDA prefill + in-pass checkpoint (us; goals: ckpt_vs_fla <= +2%, split_over_ckpt >= 1.10x)",
                    columns, result["prefill"], ceil, dev)
        for r in result["resume"]:
            print(f"resume from the checkpoint, H{r['H']}: o err {r['o_err_resumed']:.3e} (unsplit {r['o_err_unsplit']:.3e})"
                  f", final state err {r['final_err_resumed']:.3e} (unsplit {r['final_err_unsplit']:.3e}), checkpoint "
                  f"err {r['checkpoint_err']:.3e}; all relative RMS vs the unsplit fp32 reference")
    if result["decode"]:
        for row in result["decode"]:
            row["graph_1call_x_floor"] = x_floor(row["graph_1call"], row["floor"])
            row["in_graph_x_floor"] = x_floor(row["in_graph"], row["floor"])
        result["graph_launch_us"] = graph_launch_us(dev)
        columns = ["op", "shape", "ours", "graph_1call", "in_graph", "anchor", "anchor_graph_1call", "anchor_in_graph",
                   "anchor_is", "floor", "graph_1call_x_floor", "in_graph_x_floor", "err", "backend", "best"]
        print_table("KDA decode (us; ours = k3serve.kernels.kda; anchor = fla; best = our fastest tile)", columns,
                    result["decode"], ceil, dev, graph_launch_note(result["graph_launch_us"]))
    save()


if __name__ == "__main__":
    main()
