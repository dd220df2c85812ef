"""MXFP4 latent MoE at K3 per-rank shapes (latent 3584, intermediate 3072, 112 local experts, top-16 of
896, 1-192 tokens), ours vs torch.

    python benchmarks/gpu_moe.py [--out gpu_moe.json] [--smoke]

ours = k3serve.kernels.moe.fused_experts (Triton w4a16: upcast in registers, SiTU-GLU and the weighted
top-k sum fused), timed on both of its kernel pairs in the same run: gemv (triton_gemv.py, CUDA cores,
what decode batches dispatch to) and dot (the tensor-core kernels: ours before the GEMV pair). Anchors =
dequantize the routed experts to bf16 + torch bmm, and the same bmm on an already-bf16 bank (4x the
weight bytes). Floor = routed experts' MXFP4 bytes / copy bandwidth (FLOPs are far below the matmul
rate at these token counts). Every path is checked against the torch reference before it is timed.

Three timings of each of our pairs: eager; `graph_1call`, a CUDA graph of one call replayed after an L2 flush
(every sample also pays the graph's launch, printed under the table); `in_graph`, one call amid a graph of 16 that
cycle through routings hitting other experts, so no call finds its experts' weights in L2, as in a decode step
(where each layer streams its own bank). The routings are the checked one (copy 0) and copies with the rank's
expert ids relabeled by a bijection of 0..E-1 (`relabeled`): the same number of experts, rows per expert and tokens
per pair, on other weights; there are enough copies for >= 128 MB of expert weights, and neighbours in the cycle
share no expert while hits x copies <= E (T1-T16); past that (T64: 70-80 hits of 112) a call alone reads 25
times L2. x_floor columns: a timing / floor; gemv_TBps = the floor's bytes / the gemv in-graph time. T192 gives the
hit experts ~3.5 rows each, as the decode step's router does at batch 64; mma = the Gluon tensor-core pair
(gluon_mma.py); scaled = the block-scaled pair (triton_scaled.py, activations as two MXFP8 terms), timed only on
sm_100 / sm_103, where it is what every batch dispatches to.
fused_in_graph / unfused_in_graph: the pair the dispatch picks for T (`backend`), with the weighted top-k sum fused
into its down kernel (what runs) and, as the finalize anchor, left out of it (`unfused_us`: an fp32 [pairs, D]
intermediate and a separate weighted sum by token)."""

from __future__ import annotations

import functools
import sys

import torch

from _gpu_common import (ceilings, check, device, floor_us, graph_launch_note, graph_launch_us, graph_us, in_graph_us,
                         l2_copies, parse_args, rel_err, report, time_ms, x_floor)
from k3serve.kernels import moe
from k3serve.kernels.moe import ExpertWeights, fused_experts, naive, situ_glu, triton_moe
from k3serve.kernels.mxfp4 import MXFP4Tensor, dequantize_mxfp4

SITU = functools.partial(situ_glu, beta=4.0, linear_beta=25.0)
TOL = 1e-2


def random_mxfp4(*shape: int, dev) -> MXFP4Tensor:
    *lead, out, inp = shape
    packed = torch.randint(0, 256, (*lead, out, inp // 2), dtype=torch.uint8, device=dev)
    scales = torch.randint(119, 123, (*lead, out, inp // 32), dtype=torch.uint8, device=dev)
    return MXFP4Tensor(packed, scales)


class TorchExperts:
    """The anchor: routed experts' rows padded per expert, bmm, SiTU, bmm, weighted index_add."""

    def __init__(self, x, weights: ExpertWeights, topk_weights, topk_ids, expert_start: int):
        local = topk_ids - expert_start
        ok = (local >= 0) & (local < weights.w1.shape[0])
        self.experts = torch.unique(local[ok])  # [A]
        rows = [torch.nonzero(local == e, as_tuple=True) for e in self.experts.tolist()]
        m = max(len(t) for t, _ in rows)
        self.x = x.new_zeros(len(rows), m, x.shape[1])  # [A, M, D]
        self.w = torch.zeros(len(rows), m, device=x.device)
        self.tok = torch.zeros(len(rows), m, dtype=torch.int64, device=x.device)
        for a, (t, j) in enumerate(rows):
            self.x[a, : len(t)], self.w[a, : len(t)], self.tok[a, : len(t)] = x[t], topk_weights[t, j], t
        self.weights, self.T, self.D = weights, x.shape[0], x.shape[1]
        self.bf16 = [self.dequant(w) for w in (weights.w1, weights.w3, weights.w2)]

    def dequant(self, w: MXFP4Tensor) -> torch.Tensor:
        return dequantize_mxfp4(w.packed[self.experts], w.scales[self.experts], torch.bfloat16)

    def run(self, w1, w3, w2) -> torch.Tensor:
        h = SITU(torch.bmm(self.x, w1.transpose(1, 2)), torch.bmm(self.x, w3.transpose(1, 2)))
        y = torch.bmm(h, w2.transpose(1, 2)).float() * self.w[..., None]  # [A, M, D]
        out = torch.zeros(self.T, self.D, device=y.device)
        return out.index_add_(0, self.tok.flatten(), y.flatten(0, 1))

    def dequant_and_run(self) -> torch.Tensor:
        return self.run(*(self.dequant(w) for w in (self.weights.w1, self.weights.w3, self.weights.w2)))


def relabeled(topk_ids: torch.Tensor, num_local: int, copy: int) -> torch.Tensor:
    """topk_ids with the local experts (ids 0..num_local-1) renamed by a bijection: copy 0 as it is; copy c sends
    the j-th hit expert to the ((c - 1) x hits + j)-th id, mod num_local, of the ids not hit followed by the hit
    ones; the other local ids fill the rest in order, other ranks' ids stay. Rows per expert and per token stay."""
    if copy == 0:
        return topk_ids
    local = topk_ids < num_local
    hit = torch.unique(topk_ids[local])
    ids = torch.arange(num_local, device=hit.device)
    order = torch.cat([ids[~torch.isin(ids, hit)], hit])
    targets = order[((copy - 1) * hit.numel() + torch.arange(hit.numel(), device=hit.device)) % num_local]
    rename = torch.empty_like(ids)
    rename[hit] = targets
    rename[~torch.isin(ids, hit)] = ids[~torch.isin(ids, targets)]
    out = torch.where(local, rename[topk_ids.clamp(max=num_local - 1)], topk_ids)
    counts = lambda t: torch.bincount(t[t < num_local], minlength=num_local).sort().values  # noqa: E731
    assert torch.equal(counts(out), counts(topk_ids)) and torch.equal(torch.unique(out[local]), targets.sort().values)
    return out


def path_us(path: str, x, weights, topk_weights, routings: list[torch.Tensor], refs: list[torch.Tensor],
            dev) -> dict[str, float | None]:
    """Eager, one-call graph and in-graph us of one kernel pair of ours (eager and one-call on the first routing,
    in graph over all), after checking it on the first and the last routing against their references (`refs`);
    None off CUDA (the Triton kernels need the device; --smoke on CPU checks the script only)."""
    if dev.type != "cuda" or (path == "scaled" and triton_moe.kernel_pair(1, dev) != "scaled"):
        return {path: None, f"{path}_graph_1call": None, f"{path}_in_graph": None}

    def run(ids: torch.Tensor = routings[0]) -> torch.Tensor:
        return triton_moe.fused_experts(x, weights, topk_weights, ids, SITU, 0, path=path)

    for ids, ref in zip((routings[0], routings[-1]), refs):
        check(f"moe {path} T{x.shape[0]}", rel_err(ref, run(ids)), TOL)
        assert triton_moe.last_path == path
    return {path: time_ms(run, dev) * 1e3, f"{path}_graph_1call": graph_us(run, dev),
            f"{path}_in_graph": in_graph_us([lambda ids=ids: run(ids) for ids in routings], dev)}


def unfused_us(x, weights, topk_weights, routings: list[torch.Tensor], ref: torch.Tensor, path: str,
               dev) -> float | None:
    """In graph, us, of the finalize anchor: `path`'s kernels with the top-k sum left out of them — each (token,
    expert) pair its own row (x repeated a pair, top-1 of weight 1), writing an fp32 [pairs, D] intermediate — then a
    separate weighted sum by token (index_add). The same expert rows and weight stream as the fused call."""
    if dev.type != "cuda":
        return None
    calls = []
    for ids in routings:
        tok, j = torch.nonzero(ids < weights.w1.shape[0], as_tuple=True)  # this rank's pairs (a sync: not timed)
        x_pairs, ids_pairs, w_pairs = x[tok], ids[tok, j][:, None], topk_weights[tok, j][:, None]
        ones = torch.ones_like(w_pairs)

        def call(x_pairs=x_pairs, ids_pairs=ids_pairs, w_pairs=w_pairs, ones=ones, tok=tok) -> torch.Tensor:
            y = triton_moe.fused_experts(x_pairs, weights, ones, ids_pairs, SITU, 0, path=path)  # [pairs, D]
            return torch.zeros(x.shape[0], y.shape[1], device=y.device).index_add_(0, tok, y * w_pairs)
        calls.append(call)
    check(f"moe {path} unfused finalize T{x.shape[0]}", rel_err(ref, calls[0]()), TOL)
    return in_graph_us(calls, dev)


def row(T: int, weights: ExpertWeights, top_k: int, num_total: int, dev, ceil) -> dict:
    E, I, D = weights.w1.shape
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    while True:  # fresh routing; at least one pair on this rank (T=1 misses it about 1 time in 8)
        topk_ids = torch.stack([torch.randperm(num_total, device=dev)[:top_k] for _ in range(T)])
        if (topk_ids < E).any():
            break
    topk_weights = torch.rand(T, top_k, device=dev)
    out = fused_experts(x, weights, topk_weights, topk_ids, SITU, 0)
    backend = moe.last_backend["fused_experts"] + (f" {triton_moe.last_path}" if dev.type == "cuda" else "")
    dispatched = triton_moe.last_path if dev.type == "cuda" else None
    ref = naive.fused_experts(x, weights, topk_weights, topk_ids, SITU, 0)
    err = rel_err(ref, out)
    check(f"moe T{T}", err, TOL)
    num_active = int(torch.unique(topk_ids[topk_ids < E]).numel())
    expert_bytes = num_active * 3 * I * D * (0.5 + 1 / 32)
    routings = [relabeled(topk_ids, E, c) for c in range(l2_copies(expert_bytes, dev))]
    refs = [ref, naive.fused_experts(x, weights, topk_weights, routings[-1], SITU, 0)]
    gemv = path_us("gemv", x, weights, topk_weights, routings, refs, dev)
    mma = path_us("mma", x, weights, topk_weights, routings, refs, dev)
    dot = path_us("dot", x, weights, topk_weights, routings, refs, dev)
    scaled = path_us("scaled", x, weights, topk_weights, routings, refs, dev)
    unfused = None if dispatched is None else unfused_us(x, weights, topk_weights, routings, ref, dispatched, dev)
    anchor = TorchExperts(x, weights, topk_weights, topk_ids, 0)
    check("torch anchor", rel_err(ref, anchor.run(*anchor.bf16)), TOL)
    pairs = int(((topk_ids >= 0) & (topk_ids < E)).sum())
    bytes_moved = expert_bytes + T * D * (2 + 4)
    flops = pairs * 6 * I * D
    floor = floor_us(bytes_moved, flops, ceil)
    gemv_in_graph = gemv["gemv_in_graph"]
    return dict(op="moe mxfp4", shape=f"T{T} (experts {num_active}, rows {pairs})", **gemv, **mma, **dot, **scaled,
                anchor=time_ms(anchor.dequant_and_run, dev) * 1e3, anchor_is="dequant to bf16 + bmm",
                bf16_bank=time_ms(lambda: anchor.run(*anchor.bf16), dev) * 1e3, floor=floor,
                gemv_graph_1call_x_floor=x_floor(gemv["gemv_graph_1call"], floor),
                gemv_in_graph_x_floor=x_floor(gemv_in_graph, floor),
                mma_in_graph_x_floor=x_floor(mma["mma_in_graph"], floor),
                dot_in_graph_x_floor=x_floor(dot["dot_in_graph"], floor),
                scaled_in_graph_x_floor=x_floor(scaled["scaled_in_graph"], floor),
                gemv_TBps="-" if gemv_in_graph is None else f"{bytes_moved / gemv_in_graph / 1e6:.2f}",
                fused_in_graph=None if dispatched is None else
                {"gemv": gemv, "mma": mma, "dot": dot, "scaled": scaled}[dispatched][f"{dispatched}_in_graph"],
                unfused_in_graph=unfused, routings=len(routings), err=f"{err:.1e}", backend=backend)


def main() -> None:
    args = parse_args(__doc__)
    dev = device(args.smoke)
    torch.manual_seed(0)
    ceil = ceilings(dev, args.smoke)
    E, I, D, top_k, total, tokens = (4, 64, 128, 4, 16, [1, 5]) if args.smoke else (112, 3072, 3584, 16, 896,
                                                                                     [1, 4, 16, 64, 192])
    weights = ExpertWeights(random_mxfp4(E, I, D, dev=dev), random_mxfp4(E, I, D, dev=dev),
                            random_mxfp4(E, D, I, dev=dev))
    rows = []
    for T in tokens:  # each row on stderr as it lands: a time limit that cuts the run keeps what was measured
        rows.append(row(T, weights, top_k, total, dev, ceil))
        print(rows[-1], file=sys.stderr, flush=True)
    columns = ["op", "shape", "gemv", "gemv_graph_1call", "gemv_in_graph", "mma", "mma_in_graph", "dot", "dot_in_graph",
               "scaled", "scaled_in_graph", "anchor", "anchor_is", "bf16_bank", "floor", "gemv_in_graph_x_floor",
               "mma_in_graph_x_floor", "dot_in_graph_x_floor", "scaled_in_graph_x_floor", "gemv_TBps", "fused_in_graph",
               "unfused_in_graph", "err", "backend"]
    launch = graph_launch_us(dev)
    report(f"MXFP4 MoE, one EP rank (us; D {D}, I {I}, {E} local of {total} experts, top-{top_k})", columns, rows,
           ceil, args.out, dev, graph_launch_note(launch), {"graph_launch_us": launch})


if __name__ == "__main__":
    main()
