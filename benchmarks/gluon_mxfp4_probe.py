"""Probe: an MXFP4 x bf16 GEMV on the tensor cores written in Gluon (triton.experimental.gluon), the lead for the
MoE experts at 2-8 rows an expert, where the CUDA-core GEMV (kernels/moe/triton_gemv.py) pays ~4.5 SASS a weight
element per row and the tensor-core pair (triton_moe.py) ~10.8.

    python benchmarks/gluon_mxfp4_probe.py --sass     # anywhere: compile for sm_90 (triton's ptxas), count SASS
    python benchmarks/gluon_mxfp4_probe.py            # on the GPU: exactness, a NaN scale, in-graph time vs floor

The kernel: swap-AB `mma_v2` (m16n8k16): A = the weight's e2m1 codes as exact bf16 (`gl.fp4_to_fp`, no scale), B =
x^T with 8 tokens as N; one MMA pair per 32-k MX group into a temporary, then acc += temp * 2^(s-127) on the fp32
fragments (exact; E8M0 255 -> NaN). `swizzle` reorders the packed bank once (at load, in a real engine) so a
lane's 8 bytes of a group are adjacent: one 8-byte load, then a permute + reshape the compiler proves equal to the
dot operand's layout (`assert_trivial`): no shared memory, no shuffles. Compiled on the CPU (triton 3.6, sm_90):
5.9 SASS a weight element for all 8 tokens. Not yet run on a GPU (2026-12-01)."""

from __future__ import annotations

import argparse
import collections
import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

ROWS, TOKENS, GROUP = 64, 8, 32  # a program: 4 warps x one m16 tile, the MMA's N, an MX group


@gluon.jit
def _scale(s):
    """E8M0 bytes (int32) -> 2^(s-127) as a product of two normal fp32 powers of two (exact for 0..254), NaN for 255."""
    half = s >> 1
    a = ((half + 64) << 23).to(gl.float32, bitcast=True)  # 2^(half - 63)
    b = ((s - half + 63) << 23).to(gl.float32, bitcast=True)  # 2^(s - half - 64)
    return gl.where(s == 255, float("nan"), a) * b


@gluon.jit
def gemv_mma(wsw, ws, x, out, K, stride_ws, stride_x, BLOCK_K: gl.constexpr):
    """out [N, 8] fp32 = W x^T for ROWS rows of W a program; wsw = swizzle(packed)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)  # its packed bytes
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    s_l: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [1, 8, 4, 1], [4, 1, 1, 1], [3, 2, 1, 0])  # 8 bytes a lane
    rb = gl.program_id(0)
    groups = K // 32
    i0 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, s_l))))  # warp
    i1 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, s_l))))  # lane // 4
    i2 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, s_l))))  # lane % 4
    i3 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, s_l))))  # the lane's bytes
    offs = i0[:, None, None, None] * 256 + i1[None, :, None, None] * 32 + i2[None, None, :, None] * 8 + i3[None, None, None, :]
    kb = gl.arange(0, 32, layout=gl.SliceLayout(1, b_l))
    tok = gl.arange(0, 8, layout=gl.SliceLayout(0, b_l))
    rows = rb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    acc = gl.zeros([64, 8], gl.float32, layout=mma)
    for k0 in range(0, K, BLOCK_K):
        for g in gl.static_range(BLOCK_K // 32):
            kg = k0 + g * 32
            lanes = gl.reshape(gl.load(wsw + (rb * groups + kg // 32) * 1024 + offs), [4, 8, 4, 4, 2])
            packed = gl.convert_layout(gl.reshape(gl.permute(lanes, [0, 4, 1, 3, 2]), [64, 16]), p_l,
                                       assert_trivial=True)
            a = gl.convert_layout(gl.fp4_to_fp(packed, gl.bfloat16, axis=1), a_l)
            b = gl.load(x + tok[None, :] * stride_x + (kg + kb)[:, None])
            part = mma_v2(a, b, gl.zeros([64, 8], gl.float32, layout=mma))
            acc = acc + part * _scale(gl.load(ws + rows * stride_ws + kg // 32).to(gl.int32))[:, None]
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    gl.store(out + rows[:, None] * 8 + cols[None, :], acc)


def swizzle(packed: torch.Tensor) -> torch.Tensor:
    """packed [N, K/2] (N % 64 == 0, K % 32 == 0) -> the kernel's byte order. Row r = rb*64 + warp*16 + rowbit*8 +
    lane_row and byte column c = group*16 + colhi*4 + lane_col (the m16n8k16 A fragment: lane = lane_row*4 + lane_col
    holds rows lane_row and lane_row + 8 at k pairs lane_col + 4j) are stored as
    [rb][group][warp][lane_row][lane_col][colhi][rowbit]: a lane's 8 bytes of a group adjacent."""
    N, half_k = packed.shape
    if N % ROWS or half_k % (GROUP // 2):
        raise ValueError(f"swizzle needs N % {ROWS} == 0 and K % {GROUP} == 0, got packed {tuple(packed.shape)}")
    v = packed.reshape(N // 64, 4, 2, 8, half_k // 16, 4, 4)  # rb, warp, rowbit, lane_row, group, colhi, lane_col
    return v.permute(0, 4, 1, 3, 6, 5, 2).contiguous().reshape(-1)


SIGNATURE = {"wsw": "*u8", "ws": "*u8", "x": "*bf16", "out": "*fp32", "K": "i32", "stride_ws": "i32", "stride_x": "i32",
             "BLOCK_K": "constexpr"}


def compile_sm90(block_k: int):
    """The kernel compiled for an H100/H200 target, on any machine (pointers and strides 16-divisible)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}
    return triton.compile(GluonASTSource(gemv_mma, SIGNATURE, {"BLOCK_K": block_k}, attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})


def sass_report(block_k: int) -> str:
    from moe_gemv_sass import loop_costs

    compiled = compile_sm90(block_k)
    usage, loops = loop_costs(compiled.asm["cubin"])
    per_thread = ROWS * block_k / 128  # weight elements a thread's K-loop iteration covers, for all 8 tokens
    body = loops[0]
    mix = ", ".join(f"{op} {n}" for op, n in collections.Counter(body).most_common(8))
    return (f"BLOCK_K {block_k}: {usage.split()[0]}, shared {compiled.metadata.shared} B, "
            f"{len(body) / per_thread:.2f} SASS a weight element (8 tokens) [{mix}]")


def run_on_gpu() -> None:
    from _gpu_common import ceilings, floor_us, in_graph_us

    from k3serve.kernels.mxfp4 import quantize_mxfp4

    dev = torch.device("cuda")
    torch.manual_seed(0)
    N, K = 3072, 3584  # one K3 expert's gate (or up) rows x the latent width
    w = quantize_mxfp4(torch.randn(N, K, device=dev) * 0.05)
    x = torch.randn(TOKENS, K, device=dev).bfloat16()
    out = torch.empty(N, TOKENS, device=dev)

    def call(packed_sw, scales, block_k=128):
        gemv_mma[(N // ROWS,)](packed_sw, scales, x, out, K, scales.stride(0), x.stride(0), BLOCK_K=block_k,
                                num_warps=4)

    call(swizzle(w.packed), w.scales)
    ref = w.dequantize(torch.float64) @ x.double().T
    print(f"relative error vs fp64: {((out.double() - ref).norm() / ref.norm()).item():.2e} (fp32 sums: ~1e-6)")
    nan_scales = w.scales.clone()
    nan_scales[5, 3] = 255
    call(swizzle(w.packed), nan_scales)
    print(f"E8M0 255 -> that row NaN: {bool(out[5].isnan().all())}, the others finite: {bool(out[6:].isfinite().all())}")
    ceil = ceilings(dev, smoke=False)
    banks = [quantize_mxfp4(torch.randn(N, K, device=dev) * 0.05) for _ in range(16)]  # together > L2
    floor = floor_us(N * K // 2 + N * K // 32, 0, ceil)  # the packed weight and its scales, read once
    for block_k in (64, 128, 256):
        swizzled = [(swizzle(b.packed), b.scales) for b in banks]
        us = in_graph_us([lambda p=p, s=s: call(p, s, block_k) for p, s in swizzled], dev)
        print(f"BLOCK_K {block_k}: {us:.1f} us in graph; bytes floor {floor:.1f} us ({floor / us:.0%} of copy BW)")
    dense = [b.dequantize(torch.bfloat16) for b in banks]
    us = in_graph_us([lambda d=d: torch.nn.functional.linear(x, d) for d in dense], dev)
    print(f"anchor, cuBLAS on the dequantized bf16 weight (4x the bytes): {us:.1f} us in graph")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sass", action="store_true", help="compile for sm_90 here and count the K loop's SASS")
    args = parser.parse_args()
    if args.sass:
        for block_k in (64, 128, 256):
            print(sass_report(block_k))
    else:
        run_on_gpu()


if __name__ == "__main__":
    main()
