"""KDA on the GPU: prefill (8K tokens, 12 / 32 heads) and pooled decode (batch 1-64), ours vs fla.

    python benchmarks/gpu_kda.py [--out gpu_kda.json] [--smoke]

ours = the public k3serve ops (fla stages, fp32 in-pass checkpoint); anchors = fla's public chunk_kda
(no checkpoint; two calls split at the checkpoint; gate fused in kernel) and fused_recurrent_kda.
Floor = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured in this run. Also reports
how far a bf16 checkpoint (what fla's return_intermediate_states gives) moves the resumed output."""

from __future__ import annotations

import sys

import torch

from _gpu_common import ceilings, check, device, floor_us, graph_ms, parse_args, rel_err, report, time_ms
from k3serve.kernels import kda
from k3serve.kernels.kda import chunk_kda, kda_decode, kda_gate, naive

K = V = 128
LB = -5.0
TOL = 1e-2


def _inputs(T: int, H: int, dev):
    q, k, v = (torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16) for _ in range(3))
    f = torch.randn(1, T, H, K, device=dev)
    A_log, dt_bias = torch.rand(H, device=dev) * 2 - 1, torch.randn(H * K, device=dev)
    beta = torch.rand(1, T, H, device=dev)
    return q, k, v, kda_gate(f, A_log, dt_bias, LB), beta, f, A_log, dt_bias


def prefill_rows(T: int, H: int, dev, ceil) -> tuple[list[dict], dict]:
    q, k, v, g, beta, f, A_log, dt_bias = _inputs(T, H, dev)
    h0 = torch.randn(1, H, K, V, device=dev)
    cut = T // 2 + 17  # a checkpoint in the middle of a chunk
    offsets = torch.tensor([cut], device=dev)
    cu = torch.tensor([0, T], device=dev)  # varlen, as the engine calls it (one sequence here)
    ours = lambda: chunk_kda(q, k, v, g, beta, None, h0, cu, use_qk_l2norm_in_kernel=True,  # noqa: E731
                             gate_lower_bound=LB)
    ours_cp = lambda: chunk_kda(q, k, v, g, beta, None, h0, cu, checkpoint_offsets=offsets,  # noqa: E731
                                use_qk_l2norm_in_kernel=True, gate_lower_bound=LB)
    o, final, cp = ours_cp()
    backend = kda.last_backend["chunk_kda"]
    ref_o, ref_final, ref_cp = naive.chunk_kda(q, k, v, g, beta, None, h0, cu, offsets, True)
    err = max(rel_err(ref_o, o), rel_err(ref_final, final), rel_err(ref_cp, cp))
    check(f"chunk_kda H{H}", err, TOL)

    # A bf16 checkpoint: resume the second half from cp rounded to bf16, against resuming from fp32.
    rest = [t[:, cut:] for t in (q, k, v, g, beta)]
    cu_rest, cu_head = torch.tensor([0, T - cut], device=dev), torch.tensor([0, cut], device=dev)
    o_fp32, final_fp32, _ = chunk_kda(*rest, None, cp, cu_rest, use_qk_l2norm_in_kernel=True, gate_lower_bound=LB)
    o_bf16, final_bf16, _ = chunk_kda(*rest, None, cp.bfloat16().float(), cu_rest, use_qk_l2norm_in_kernel=True,
                                      gate_lower_bound=LB)
    resume = {"H": H, "o_err_fp32_checkpoint": rel_err(ref_o[:, cut:], o_fp32),
              "o_err_bf16_checkpoint": rel_err(ref_o[:, cut:], o_bf16),
              "first_64_tokens_o_err_bf16_vs_fp32": rel_err(o_fp32[:, :64], o_bf16[:, :64]),
              "final_err_fp32_checkpoint": rel_err(ref_final, final_fp32),
              "final_err_bf16_checkpoint": rel_err(ref_final, final_bf16)}

    bytes_moved = T * H * (3 * K * 2 + K * 4 + 4 + V * 2) + 2 * H * K * V * 4
    C = 64
    flops = T * H * (6 * C * K + 4 * C * V + 6 * K * V)
    floor = floor_us(bytes_moved, flops, ceil)
    rows = [dict(op="prefill", shape=f"T{T} H{H}", ours=time_ms(ours, dev) * 1e3, graph=None, anchor=None,
                 anchor_is="", floor=floor, err=f"{err:.1e}", backend=backend)]
    rows.append(dict(op="prefill +ckpt", shape=f"T{T} H{H} ckpt@{cut}", ours=time_ms(ours_cp, dev) * 1e3,
                     graph=None, anchor=None, anchor_is="", floor=floor, err=f"{err:.1e}", backend=backend))
    if dev.type == "cuda":
        from fla.ops.kda import chunk_kda as fla_chunk

        common = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=LB)

        def fla_plain():
            return fla_chunk(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **common)

        def fla_split():
            _, s = fla_chunk(*(t[:, :cut] for t in (q, k, v, g, beta)), initial_state=h0, cu_seqlens=cu_head,
                             **common)
            return fla_chunk(*rest, initial_state=s, cu_seqlens=cu_rest, **common)

        def fla_gate():
            return fla_chunk(q, k, v, f, beta, initial_state=h0, cu_seqlens=cu, use_gate_in_kernel=True, A_log=A_log,
                             dt_bias=dt_bias, **common)

        check("fla chunk_kda", rel_err(ref_o, fla_plain()[0]), TOL)
        check("fla gate in kernel", rel_err(ref_o, fla_gate()[0]), TOL)
        rows[0].update(anchor=time_ms(fla_plain, dev) * 1e3, anchor_is="fla chunk_kda, pre-gated g")
        rows[1].update(anchor=time_ms(fla_split, dev) * 1e3, anchor_is="fla, 2 calls split at ckpt")
        rows.append(dict(op="prefill (gate fused)", shape=f"T{T} H{H}", ours=None, graph=None,
                         anchor=time_ms(fla_gate, dev) * 1e3, anchor_is="fla, gate in kernel (raw f)", floor=floor,
                         err="-", backend="fla"))
    return rows, resume


def decode_row(N: int, H: int, dev, ceil) -> dict:
    num_slots = 2 * N + 3
    pool = torch.randn(num_slots, H, K, V, device=dev)
    slots = torch.randperm(num_slots, device=dev)[:N]
    q, k, v, g, beta, *_ = (t[0] if t.dim() > 1 else t for t in _inputs(N, H, dev))
    ref_pool = pool.clone()
    o = kda_decode(q, k, v, g, beta, pool, slots, use_qk_l2norm_in_kernel=True)
    backend = kda.last_backend["kda_decode"]
    ref_o = naive.kda_decode(q, k, v, g, beta, ref_pool, slots, None, True)
    err = max(rel_err(ref_o, o), rel_err(ref_pool[slots], pool[slots]))
    check(f"kda_decode N{N} H{H}", err, TOL)
    ours = lambda: kda_decode(q, k, v, g, beta, pool, slots, use_qk_l2norm_in_kernel=True)  # noqa: E731
    bytes_moved = 2 * N * H * K * V * 4 + N * H * (3 * K * 2 + K * 4 + 4 + V * 2)
    row = dict(op="decode", shape=f"N{N} H{H}", ours=time_ms(ours, dev) * 1e3, graph=graph_ms(ours, dev),
               anchor=None, anchor_is="", floor=floor_us(bytes_moved, 4 * N * H * K * V, ceil), err=f"{err:.1e}",
               backend=backend)
    if row["graph"] is not None:
        row["graph"] *= 1e3
    if dev.type == "cuda":
        from fla.ops.kda import fused_recurrent_kda

        state = pool[slots].contiguous()

        def fla_decode():
            return fused_recurrent_kda(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                       initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)

        row.update(anchor=time_ms(fla_decode, dev) * 1e3, anchor_is="fla fused_recurrent_kda (B=N, T=1)")
    return row


def main() -> None:
    args = parse_args(__doc__)
    dev = device(args.smoke)
    torch.manual_seed(0)
    ceil = ceilings(dev, args.smoke)
    T, batches = (130, [1, 3]) if args.smoke else (8192, [1, 4, 16, 64])
    rows, resumes = [], []
    for H in ([2] if args.smoke else [12, 32]):
        prefill, resume = prefill_rows(T, H, dev, ceil)
        print(prefill, resume, file=sys.stderr, flush=True)  # progress, in case a time limit cuts the run
        rows += prefill
        resumes.append(resume)
    for H in ([2] if args.smoke else [12, 32]):
        for N in batches:
            rows.append(decode_row(N, H, dev, ceil))
            print(rows[-1], file=sys.stderr, flush=True)
    for row in rows:
        row["x_floor"] = f"{row['ours'] / row['floor']:.1f}" if row["ours"] else "-"
    columns = ["op", "shape", "ours", "graph", "anchor", "anchor_is", "floor", "x_floor", "err", "backend"]
    report("KDA (us; ours = k3serve.kernels.kda; graph = CUDA-graph replay of ours)", columns, rows, ceil,
           args.out, dev)
    for r in resumes:
        print(f"resume from checkpoint, H{r['H']}: o err fp32 ckpt {r['o_err_fp32_checkpoint']:.2e}, bf16 ckpt "
              f"{r['o_err_bf16_checkpoint']:.2e}; first 64 tokens bf16 vs fp32 {r['first_64_tokens_o_err_bf16_vs_fp32']:.2e};"
              f" final state err fp32 {r['final_err_fp32_checkpoint']:.2e}, bf16 {r['final_err_bf16_checkpoint']:.2e}")
    if args.out is not None:
        import json

        data = json.loads(args.out.read_text())
        data["resume"] = resumes
        args.out.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
