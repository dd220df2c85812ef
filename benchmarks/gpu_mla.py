"""Absorbed MLA decode over the paged latent cache (block 64, 576-dim keys, 512-dim values), ours vs torch.

    python benchmarks/gpu_mla.py [--out gpu_mla.json] [--smoke] [--sweep [--splits 4,6,7,8,9,12,16]]

ours = k3serve.kernels.mla.mla_decode_paged (Triton split-KV + merge; seq_lens on the GPU, no sync), eager;
`graph_1call` = a CUDA graph of the kernels alone, one call, replayed after an L2 flush (every sample also pays the
graph's launch, printed under the table); `in_graph` = one call amid a graph that cycles through copies of the
cache: each copy is the same sequences' pages elsewhere in one larger cache (other block tables), the copies
together >= 128 MB, so every call reads its pages from HBM, as in a decode step whose layers' caches lie far apart.
anchor = torch gather of the blocks + einsum/softmax (the reference a serving stack would write without a kernel),
eager only. Floor = KV + q + o bytes / copy bandwidth; bw = floor / in_graph (the share of copy bandwidth).
`splits` = the split count kernels/mla/split_rule.py picks.

--sweep: a second table at N16 ctx8K, N64 ctx8K, N16 ctx32K, N4 ctx32K, N1 ctx32K (12 heads): the rule's pick
(also with each of SWEEP_KNOBS' warps and stages), each `waves` of the rule, and each explicit split count of
--splits (also with SWEEP_KNOBS' stages), all timed in graph, each first checked against the fp32 reference.
--smoke: tiny shapes on the CPU, the kernels through the Triton interpreter (fp16: it cannot multiply bf16)."""

from __future__ import annotations

import json
import sys

import torch

from _gpu_common import (ceilings, check, device, device_name, floor_us, graph_launch_note, graph_launch_us, graph_us,
                         in_graph_us, l2_copies, parse_args, print_table, rel_err, time_ms, use_triton_interpreter,
                         x_floor)
from k3serve.kernels import mla
from k3serve.kernels.mla import mla_decode_paged
from k3serve.kernels.mla.split_rule import default_waves, head_groups, num_stages, split_plan

L, R, BLOCK = 512, 64, 64
SCALE = 192**-0.5
TOL = 1e-2
ANCHOR_TOL = 2e-2  # the anchor runs its einsum/softmax in bf16: 1.05e-2 seen at N4 ctx2K on the H200
SWEEP_SHAPES = [(16, 8192), (64, 8192), (16, 32768), (4, 32768), (1, 32768)]
SWEEP_HEADS = 12
SWEEP_WAVES = (1, 2, 4)
# Launch knobs beside the rule's (12 heads: 4 warps, 5 stages, two pages in flight a program, one program an SM,
# splits for one wave; kernels/mla/split_rule.py): the rule before 2026-12-01e (3 stages: one page in flight, two
# programs an SM, splits for two waves) and 8 warps (128 registers a thread instead of 255).
SWEEP_KNOBS = {"1 page in flight": {"num_stages": 3}, "8 warps": {"num_warps": 8}}


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


class DecodeCase:
    """N sequences of ctx tokens (the first 100 shorter: one ragged), H heads, and `copies` block tables over one
    cache: copy i's pages are its own, so cycling through the tables reads copies * N * ctx tokens' pages."""

    def __init__(self, N: int, ctx: int, H: int, dev: torch.device, dtype: torch.dtype) -> None:
        blocks = -(-ctx // BLOCK)
        self.copies = l2_copies(N * blocks * BLOCK * (L + R) * 2, dev)
        num_blocks = self.copies * N * blocks + 7
        self.kv = torch.randn(num_blocks, BLOCK, L + R, device=dev, dtype=dtype)
        self.tables = torch.randperm(num_blocks, device=dev)[: self.copies * N * blocks].reshape(
            self.copies, N, blocks).int()
        self.lens = torch.full((N,), ctx, device=dev)
        self.lens[0] = max(ctx - 100, 1)
        self.lens32 = self.lens.int()
        self.q_latent = torch.randn(N, H, L, device=dev, dtype=dtype)
        self.q_pe = torch.randn(N, H, R, device=dev, dtype=dtype)
        self.ctx = ctx
        total = int(self.lens.sum())
        self.bytes_moved = total * (L + R) * 2 + N * H * (L + R) * 2 + N * H * (L * 2 + 4)
        self.flops = 2 * H * total * (L + R + L)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 torch answer on the first copy's tables."""
        return torch_decode(self.q_latent, self.q_pe, self.kv, self.tables[0], self.lens, torch.float32)

    def public(self) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_decode_paged(self.q_latent, self.q_pe, self.kv, self.tables[0], self.lens, SCALE, L)

    def kernel(self, copy: int = 0, **knobs) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton kernels alone (what the public call runs on CUDA) on one copy's tables; knobs: num_splits,
        waves, num_warps, num_stages."""
        from k3serve.kernels.mla import triton_decode

        return triton_decode.mla_decode_paged(self.q_latent, self.q_pe, self.kv, self.tables[copy], self.lens32,
                                              SCALE, self.ctx, **knobs)

    def in_graph(self, dev: torch.device, **knobs) -> float | None:
        return in_graph_us([lambda c=c: self.kernel(c, **knobs) for c in range(self.copies)], dev)


def _err(ref: tuple[torch.Tensor, torch.Tensor], out: tuple[torch.Tensor, torch.Tensor]) -> float:
    return max(rel_err(ref[0], out[0]), (out[1] - ref[1]).abs().max().item())


def _bw(floor: float, us: float | None) -> str:
    return "-" if us is None else f"{100 * floor / us:.0f}%"


def _num_sm(dev: torch.device) -> int:
    from k3serve.kernels.mla import triton_decode

    return triton_decode.num_sm(dev)


def _stages(H: int, dev: torch.device) -> int:
    from k3serve.kernels.mla import triton_decode

    return num_stages(H, triton_decode.shared_per_block(dev))


def row(N: int, ctx: int, H: int, dev, ceil, dtype) -> dict:
    case = DecodeCase(N, ctx, H, dev, dtype)
    ref = case.reference()
    out = case.public()
    backend = mla.last_backend["mla_decode_paged"]
    err = max(_err(ref, out), _err(ref, case.kernel()))
    check(f"mla N{N} ctx{ctx} H{H}", err, TOL)
    anchor_o, _ = torch_decode(case.q_latent, case.q_pe, case.kv, case.tables[0], case.lens)
    check("torch anchor", rel_err(ref[0], anchor_o), ANCHOR_TOL)
    graph = graph_us(case.kernel, dev)
    in_graph = case.in_graph(dev)
    floor = floor_us(case.bytes_moved, case.flops, ceil)
    splits, _ = split_plan(N, head_groups(H), -(-ctx // BLOCK), _num_sm(dev), default_waves(_stages(H, dev)))
    return dict(op="mla decode", shape=f"N{N} ctx{ctx} H{H}", splits=splits, ours=time_ms(case.public, dev) * 1e3,
                graph_1call=graph, in_graph=in_graph,
                anchor=time_ms(lambda: torch_decode(case.q_latent, case.q_pe, case.kv, case.tables[0], case.lens),
                               dev) * 1e3,
                anchor_is="torch gather + einsum", floor=floor, graph_1call_x_floor=x_floor(graph, floor),
                in_graph_x_floor=x_floor(in_graph, floor), bw=_bw(floor, in_graph), copies=case.copies,
                err=f"{err:.1e}", backend=backend)


def sweep_rows(N: int, ctx: int, dev, ceil, dtype, split_counts: list[int]) -> list[dict]:
    """The rule's pick, each waves of the rule and each explicit split count, one row each, timed in graph."""
    case = DecodeCase(N, ctx, SWEEP_HEADS, dev, dtype)
    ref = case.reference()
    floor = floor_us(case.bytes_moved, case.flops, ceil)
    sms, pages = _num_sm(dev), -(-ctx // BLOCK)
    variants = {"rule": {}, **{f"rule, {name}": knobs for name, knobs in SWEEP_KNOBS.items()},
                **{f"waves {w}": {"waves": w} for w in SWEEP_WAVES},
                **{f"splits {s}": {"num_splits": s} for s in split_counts},
                **{f"splits {s}, {name}": {"num_splits": s, **knobs} for s in split_counts
                   for name, knobs in SWEEP_KNOBS.items() if "num_stages" in knobs}}
    rows = []
    for name, knobs in variants.items():
        check(f"mla N{N} ctx{ctx} {name}", _err(ref, case.kernel(**knobs)), TOL)
        stages = knobs.get("num_stages", _stages(SWEEP_HEADS, dev))
        splits, per_split = split_plan(N, head_groups(SWEEP_HEADS), pages, sms,
                                       knobs.get("waves", default_waves(stages)), knobs.get("num_splits"))
        us = case.in_graph(dev, **knobs)
        rows.append(dict(shape=f"N{N} ctx{ctx} H{SWEEP_HEADS}", variant=name, splits=splits, pages_per_split=per_split,
                         programs=N * head_groups(SWEEP_HEADS) * splits,
                         wave_fill=f"{N * head_groups(SWEEP_HEADS) * splits / sms:.2f}", in_graph=us, floor=floor,
                         in_graph_x_floor=x_floor(us, floor), bw=_bw(floor, us)))
    rule_us = rows[0]["in_graph"]
    for r in rows:
        r["vs_rule"] = "-" if None in (r["in_graph"], rule_us) else f"{r['in_graph'] / rule_us:.2f}"
    return rows


def main() -> None:
    def options(parser) -> None:
        parser.add_argument("--sweep", action="store_true",
                            help="also time the rule's waves and explicit split counts at the sweep shapes")
        parser.add_argument("--splits", default="4,6,7,8,9,12,16", help="explicit split counts the sweep times")

    args = parse_args(__doc__, options)
    dev = device(args.smoke)
    if dev.type == "cpu":
        use_triton_interpreter()
    torch.manual_seed(0)
    ceil = ceilings(dev, args.smoke)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    split_counts = [int(s) for s in args.splits.split(",")]
    if args.smoke:
        shapes, sweep_shapes, split_counts = [(1, 100, 12), (2, 200, 16)], [(2, 200)], split_counts[:1]
    else:
        shapes = [(N, ctx, 12) for N in (1, 4, 16, 64) for ctx in (2048, 8192, 32768)]
        shapes += [(16, 8192, 16), (16, 8192, 128), (64, 8192, 128)]
        sweep_shapes = SWEEP_SHAPES
    result = {"device": device_name(dev), "ceilings": ceil, "graph_launch_us": graph_launch_us(dev), "rows": [],
              "sweep": []}

    def save() -> None:  # after every table: a time limit that cuts the run keeps what was measured
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))

    for N, ctx, H in shapes:
        result["rows"].append(row(N, ctx, H, dev, ceil, dtype))
        print(result["rows"][-1], file=sys.stderr, flush=True)
    save()
    columns = ["op", "shape", "splits", "ours", "graph_1call", "in_graph", "anchor", "anchor_is", "floor",
               "graph_1call_x_floor", "in_graph_x_floor", "bw", "err", "backend"]
    print_table("MLA decode (us; block 64, L 512 + R 64, bf16 cache)", columns, result["rows"], ceil, dev,
                graph_launch_note(result["graph_launch_us"]))
    if args.sweep:
        for N, ctx in sweep_shapes:
            result["sweep"] += sweep_rows(N, ctx, dev, ceil, dtype, split_counts)
            save()
        print_table("MLA decode split sweep (us in graph; vs_rule = time / the rule's time)",
                    ["shape", "variant", "splits", "pages_per_split", "programs", "wave_fill", "in_graph", "floor",
                     "in_graph_x_floor", "bw", "vs_rule"], result["sweep"], ceil, dev)


if __name__ == "__main__":
    main()
