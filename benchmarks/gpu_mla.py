"""Absorbed MLA decode over the paged latent cache (block 64, 576-dim keys, 512-dim values), ours vs torch.

    python benchmarks/gpu_mla.py [--out gpu_mla.json] [--smoke] [--sweep]

ours = k3serve.kernels.mla.mla_decode_paged (Triton split-KV + merge; seq_lens on the GPU, no sync);
graph = CUDA-graph replay of the kernels alone; anchor = torch gather of the blocks + einsum/softmax
(the reference a serving stack would write without a kernel). Floor = KV + q + o bytes / copy bandwidth."""

from __future__ import annotations

import torch

from _gpu_common import ceilings, check, device, floor_us, graph_ms, parse_args, rel_err, report, time_ms
from k3serve.kernels import mla
from k3serve.kernels.mla import mla_decode_paged

L, R, BLOCK = 512, 64, 64
SCALE = 192**-0.5
TOL = 1e-2


def torch_decode(q_latent, q_pe, kv, tables, lens, dtype=None):
    """Gather every sequence's blocks (padded to the longest), masked softmax, weighted sum."""
    dtype = dtype or kv.dtype
    kvg = kv[tables.long()].flatten(1, 2).to(dtype)  # [N, S, L+R]
    s = (torch.einsum("nhl,nsl->nhs", q_latent.to(dtype), kvg[..., :L])
         + torch.einsum("nhr,nsr->nhs", q_pe.to(dtype), kvg[..., L:])).float() * SCALE
    s = s.masked_fill(torch.arange(s.shape[-1], device=s.device) >= lens[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("nhs,nsl->nhl", torch.exp(s - lse[..., None]).to(dtype), kvg[..., :L])
    return o, lse


def row(N: int, ctx: int, H: int, dev, ceil, dtype, sweep: bool = False) -> dict:
    blocks = -(-ctx // BLOCK)
    kv = torch.randn(N * blocks + 7, BLOCK, L + R, device=dev, dtype=dtype)
    tables = torch.randperm(N * blocks + 7, device=dev)[: N * blocks].reshape(N, blocks).int()
    lens = torch.full((N,), ctx, device=dev)
    lens[0] = max(ctx - 100, 1)  # one ragged sequence
    q_latent = torch.randn(N, H, L, device=dev, dtype=dtype)
    q_pe = torch.randn(N, H, R, device=dev, dtype=dtype)
    o, lse = mla_decode_paged(q_latent, q_pe, kv, tables, lens, SCALE, L)
    backend = mla.last_backend["mla_decode_paged"]
    ref_o, ref_lse = torch_decode(q_latent, q_pe, kv, tables, lens, torch.float32)
    err = max(rel_err(ref_o, o), (lse - ref_lse).abs().max().item())
    check(f"mla N{N} ctx{ctx} H{H}", err, TOL)
    anchor_o, _ = torch_decode(q_latent, q_pe, kv, tables, lens)
    check("torch anchor", rel_err(ref_o, anchor_o), TOL)

    ours = lambda: mla_decode_paged(q_latent, q_pe, kv, tables, lens, SCALE, L)  # noqa: E731
    graph, swept = None, {"best": "-"}
    if dev.type == "cuda":
        from k3serve.kernels.mla import triton_decode

        lens32 = lens.int()
        graph = graph_ms(lambda: triton_decode.mla_decode_paged(q_latent, q_pe, kv, tables, lens32, SCALE, ctx), dev)
        if sweep and N >= 16 and ctx >= 8192:  # the goal region: >= 75% of bandwidth
            knobs = [(w, wp, st) for w in (1, 2, 4) for wp in (4, 8) for st in (1, 2, 3)]
            tried = {}
            for waves, warps, stages in knobs:
                ms = graph_ms(lambda: triton_decode.mla_decode_paged(  # noqa: B023
                    q_latent, q_pe, kv, tables, lens32, SCALE, ctx, waves=waves, num_warps=warps, num_stages=stages),
                    dev)
                tried[f"waves{waves}w{warps}s{stages}"] = None if ms is None else round(ms * 1e3, 1)
            swept = dict(sweep=tried, best=min((t, c) for c, t in tried.items() if t is not None)[1])
    total = int(lens.sum())
    bytes_moved = total * (L + R) * 2 + N * H * (L + R) * 2 + N * H * (L * 2 + 4)
    flops = 2 * H * total * (L + R + L)
    return dict(op="mla decode", shape=f"N{N} ctx{ctx} H{H}", ours=time_ms(ours, dev) * 1e3,
                graph=None if graph is None else graph * 1e3,
                anchor=time_ms(lambda: torch_decode(q_latent, q_pe, kv, tables, lens), dev) * 1e3,
                anchor_is="torch gather + einsum", floor=floor_us(bytes_moved, flops, ceil), err=f"{err:.1e}",
                backend=backend, **swept)


def main() -> None:
    args = parse_args(__doc__, lambda p: p.add_argument(
        "--sweep", action="store_true", help="also time the kernel's waves/warps/stages at N >= 16, ctx >= 8K"))
    dev = device(args.smoke)
    torch.manual_seed(0)
    ceil = ceilings(dev, args.smoke)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.smoke:
        shapes = [(1, 100, 12), (3, 300, 16)]
    else:
        shapes = [(N, ctx, 12) for N in (1, 4, 16, 64) for ctx in (2048, 8192, 32768)]
        shapes += [(16, 8192, 16), (16, 8192, 128), (64, 8192, 128)]
    rows = [row(N, ctx, H, dev, ceil, dtype, sweep=args.sweep) for N, ctx, H in shapes]
    for r in rows:
        r["x_floor"] = f"{r['ours'] / r['floor']:.1f}"
        r["graph_x_floor"] = "-" if r["graph"] is None else f"{r['graph'] / r['floor']:.1f}"
    columns = ["op", "shape", "ours", "graph", "anchor", "anchor_is", "floor", "x_floor", "graph_x_floor", "err",
               "backend", "best"]
    report("MLA decode (us; block 64, L 512 + R 64, bf16 cache)", columns, rows, ceil, args.out, dev)


if __name__ == "__main__":
    main()
