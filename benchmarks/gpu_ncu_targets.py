"""Targets for Nsight Compute (benchmarks/gpu_ncu.sh): each runs one op of a goal the issue still misses, at the shape
of its goal, a few times (the first calls compile and warm up; the script profiles a later launch).

    python benchmarks/gpu_ncu_targets.py TARGET

    mla       MLA decode N16 ctx8K, 12 heads (the rule's splits + the merge)          goal >= 75% of bandwidth
    kda       KDA decode step N16 H12 (K3 rank)                                        goal <= 1.3x the state floor
    moe_gemv1, moe_gemv16   MXFP4 experts T1 / T16, GEMV pair (the batch 1-8 path)  goal >= 60% of bandwidth
    moe_mma64 MXFP4 experts T64, Gluon MMA pair (the batch 9-192 path)
    linear    skinny GEMM at batch 1 on the KDA stacked projection 6284x7168           the batch-1 step's GEMMs

Every target first checks its op against the torch reference and that it ran the kernel ncu is told to profile, not
a fallback (either stops it before ncu profiles anything)."""

from __future__ import annotations

import functools
import sys

import torch

from _gpu_common import check, rel_err

CALLS = 6  # the script profiles launch 5 of each kernel name (launch-skip 4): compiled, warm, not the last


def check_ran(name: str, ran: str, wanted: str) -> None:
    """A fallback would leave ncu nothing to match (or another kernel): stop before it profiles."""
    if ran != wanted:
        raise SystemExit(f"{name}: ran {ran!r}, not {wanted!r}; nothing of the target to profile")


def mla() -> None:
    from gpu_mla import DecodeCase

    case = DecodeCase(16, 8192, 12, torch.device("cuda"), torch.bfloat16)
    ref = case.reference()
    out = case.kernel()
    check("mla N16 ctx8K", max(rel_err(ref[0], out[0]), (out[1] - ref[1]).abs().max().item()), 1e-2)
    for _ in range(CALLS):
        case.kernel()


def kda() -> None:
    from gpu_kda import K, V, kda_inputs

    from k3serve.kernels import kda
    from k3serve.kernels.kda import kda_decode, naive

    N, H = 16, 12
    dev = torch.device("cuda")
    pool = torch.randn(4 * N, H, K, V, device=dev)
    slots = torch.randperm(4 * N, device=dev)[:N]
    _, _, _, g, beta, *_ = (t[0] if t.dim() > 1 else t for t in kda_inputs(N, H, dev))
    proj = torch.randn(N, H * (2 * K + V), device=dev, dtype=torch.bfloat16)
    q, k, v = (t.reshape(N, H, -1) for t in proj.split([H * K, H * K, H * V], dim=-1))
    ref_pool = pool.clone()
    o = kda_decode(q, k, v, g, beta, pool, slots, use_qk_l2norm_in_kernel=True)
    check_ran("kda decode", kda.last_backend["kda_decode"], "triton")
    ref = naive.kda_decode(q, k, v, g, beta, ref_pool, slots, None, True)
    check("kda decode N16 H12", max(rel_err(ref, o), rel_err(ref_pool[slots], pool[slots])), 1e-2)
    for _ in range(CALLS):
        kda_decode(q, k, v, g, beta, pool, slots, use_qk_l2norm_in_kernel=True)


def _moe(T: int, path: str) -> None:
    from gpu_moe import SITU, random_mxfp4

    from k3serve.kernels.moe import ExpertWeights, naive, triton_moe

    E, I, D, TOP_K, TOTAL = 112, 3072, 3584, 16, 896
    dev = torch.device("cuda")
    w = ExpertWeights(random_mxfp4(E, I, D, dev=dev), random_mxfp4(E, I, D, dev=dev), random_mxfp4(E, D, I, dev=dev))
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(TOTAL, device=dev)[:TOP_K] for _ in range(T)])
    ids[0, 0] = 0  # at least one pair on this rank
    tw = torch.rand(T, TOP_K, device=dev)
    run = functools.partial(triton_moe.fused_experts, x, w, tw, ids, SITU, 0, path=path)
    check(f"moe {path} T{T}", rel_err(naive.fused_experts(x, w, tw, ids, SITU, 0), run()), 1e-2)
    check_ran(f"moe {path} T{T}", triton_moe.last_path, path)  # "mma" falls back to "dot" where it cannot run
    for _ in range(CALLS):
        run()
    hit = ids[ids < E]
    print(f"T{T}: experts hit {int(torch.unique(hit).numel())}, rows {int(hit.numel())}")


def linear() -> None:
    from k3serve.kernels import linear as linear_op
    from k3serve.kernels.linear import linear as skinny

    dev = torch.device("cuda")
    x = torch.randn(1, 7168, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(6284, 7168, device=dev) / 7168**0.5).to(torch.bfloat16)
    check("linear T1 6284x7168", rel_err(x.float() @ w.float().T, skinny(x, w)), 1e-2)
    check_ran("linear", linear_op.last_backend["linear"], "triton")
    for _ in range(CALLS):
        skinny(x, w)


TARGETS = {"mla": mla, "kda": kda, "moe_gemv1": lambda: _moe(1, "gemv"), "moe_gemv16": lambda: _moe(16, "gemv"),
           "moe_mma64": lambda: _moe(64, "mma"), "linear": linear}

if __name__ == "__main__":
    torch.manual_seed(0)
    TARGETS[sys.argv[1]]()
    torch.cuda.synchronize()
