"""Static cost of the MoE GEMV kernels (kernels/moe/triton_gemv.py) on sm_90, without a GPU.

    python benchmarks/moe_gemv_sass.py

Compiles every autotune config (at K3 shapes: D 3584, I 3072, so no K or column tail) for an H100/H200
target with the ptxas that ships with triton, and prints its registers per thread, local-memory stack
(spills), how many of its programs fit on an SM (registers, warps, shared memory) against the
PROGRAMS_PER_SM it launches, and the SASS instructions of the K loop per weight element, with the loop's
mix. At ~32 weight elements per SM per clock (4.2 TB/s of MXFP4 on 132 SMs at 1.98 GHz) and 128
thread-instructions per SM per clock, a loop that spends N instructions per element reaches at most 4/N
of HBM bandwidth."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3serve.kernels.moe import triton_gemv

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
UP_ARGS = ("x:*bf16 w1p:*i32 w1s:*u8 w3p:*i32 w3s:*u8 h:*fp32 out:*fp32 sorted_pairs:*i32 expert_starts:*i32 "
           "expert_counts:*i32 active_experts:*i32 num_active:*i32 top_k:i32 N:i32 K:i32 beta:fp32 "
           "linear_beta:fp32 rows_bucket:i32 out_numel:i32 stride_x:i32 stride_pe:i32 stride_pn:i32 stride_se:i32 "
           "stride_sn:i32 stride_h:i32")
DOWN_ARGS = ("h:*fp32 w2p:*i32 w2s:*u8 out:*fp32 topk_weights:*fp32 sorted_pairs:*i32 expert_starts:*i32 "
             "expert_counts:*i32 active_experts:*i32 num_active:*i32 top_k:i32 N:i32 K:i32 rows_bucket:i32 "
             "stride_h:i32 stride_pe:i32 stride_pn:i32 stride_se:i32 stride_sn:i32 stride_out:i32")
D, I = 3584, 3072  # K3 per-rank latent and intermediate widths
SM90_REGS, SM90_SMEM, SM90_WARPS, SM90_PROGRAMS = 65536, 228 * 1024, 64, 32  # per SM


def compile_sm90(kernel, args: str, constants: dict, num_warps: int):
    """The compiled kernel for sm_90, pointers and strides assumed 16-divisible (as at K3 shapes)."""
    signature = dict(a.split(":") for a in args.split())
    signature.update({name: "constexpr" for name in constants})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
             if kind.startswith("*") or name.startswith("stride")}
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": 1})


def fitting_programs(registers: int, shared: int, num_warps: int) -> int:
    """Programs of num_warps warps resident on one sm_90 SM (registers are granted 8 a thread at a time)."""
    by_registers = SM90_REGS // (-(-registers // 8) * 8 * 32 * num_warps)
    by_shared = SM90_SMEM // shared if shared else SM90_PROGRAMS
    return min(SM90_PROGRAMS, SM90_WARPS // num_warps, by_registers, by_shared)


def loop_costs(cubin: bytes) -> tuple[str, list[list[str]]]:
    """(resource usage line, opcodes of each innermost loop that loads from global memory: the K loops, largest
    first)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True,
                               text=True, check=True).stdout.strip().splitlines()[-1].strip()
    address = re.compile(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
    labels, code, label = {}, [], None
    for line in sass.splitlines():
        if m := re.match(r"\s*\.L_x_(\d+):", line):
            label = m.group(1)
        elif m := address.search(line):
            labels.setdefault(label, int(m.group(1), 16))
            code.append((int(m.group(1), 16), m.group(2), line))
    spans = []  # (first, last address) of each backward branch's loop
    for at, _, line in code:
        target = re.search(r"BRA.*\.L_x_(\d+)", line)
        if target and labels.get(target.group(1), at + 1) < at:
            spans.append((labels[target.group(1)], at))
    innermost = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    loops = [[op for at, op, _ in code if a <= at <= b] for a, b in innermost]
    return usage, sorted((body for body in loops if "LDG" in body), key=len, reverse=True)


def main() -> None:
    kernels = (("up", triton_gemv.gemv_up_kernel, UP_ARGS, {"ACT": 1}, 2, (I, D)),
               ("down", triton_gemv.gemv_down_kernel, DOWN_ARGS, {}, 1, (D, I)))
    for name, kernel, args, extra, matrices, (n, k) in kernels:
        for config in kernel.configs:
            tiles = config.kwargs
            even = {"EVEN_K": k % tiles["BLOCK_K"] == 0, "EVEN_N": n % tiles["BLOCK_N"] == 0}
            compiled = compile_sm90(kernel.fn.fn, args, {**tiles, **extra, **even, "PTX": True}, config.num_warps)
            usage, loops = loop_costs(compiled.asm["cubin"])
            registers = int(re.search(r"REG:(\d+)", usage).group(1))
            fits = fitting_programs(registers, compiled.metadata.shared, config.num_warps)
            per_thread = matrices * tiles["BLOCK_N"] * tiles["BLOCK_K"] / (32 * config.num_warps)
            costs = ", ".join(f"{len(body) / per_thread:.2f}" for body in loops)
            mix = ", ".join(f"{op} {count}" for op, count in collections.Counter(loops[0]).most_common(8))
            print(f"{name} {tiles} warps {config.num_warps}: {usage.split()[0]} {usage.split()[1]}, "
                  f"{fits} fit{'' if fits >= tiles['PROGRAMS_PER_SM'] else ' (FEWER THAN LAUNCHED)'}, "
                  f"{costs} SASS/element  [{mix}]")

if __name__ == "__main__":
    main()
