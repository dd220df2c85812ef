"""The inline PTX of the MoE GEMV kernels (kernels/moe/triton_gemv.py) runs only on the GPU; Triton's
interpreter runs their plain-Triton twins instead. Here the PTX strings themselves are executed on CPU,
one instruction at a time on numpy arrays (the dozen PTX instructions they use), and must give exactly
the E2M1 table's values and the activations' bits: the decode of all 256 bytes in every position and of
random words, bf16 and fp32 activations read 16 bytes at a time."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("triton")

from k3serve.kernels.moe import triton_gemv  # noqa: E402

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def run_ptx(asm: str, num_outputs: int, inputs: list[np.ndarray], memory: np.ndarray | None = None) -> list:
    """Execute an inline-asm body ("{ ...; ...; }", operands $0.. outputs then inputs) on uint32 arrays."""
    regs = {f"${num_outputs + i}": np.asarray(v) for i, v in enumerate(inputs)}

    def value(token: str) -> np.ndarray:
        return regs[token] if token in regs else np.uint32(int(token, 0))

    def load_word(address: np.ndarray) -> np.ndarray:
        at = address.astype(np.int64)
        return sum(memory[at + b].astype(np.uint32) << np.uint32(8 * b) for b in range(4)).astype(np.uint32)

    for statement in asm.strip().removeprefix("{").removesuffix("}").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, rest = statement.split(None, 1)
        if op.startswith("ld.global.nc"):
            dsts, base, offset = re.match(r"\{?([^}\[]*?)\}?,\s*\[(\$\d+)(?:\+(\d+))?\]", rest).groups()
            address = value(base).astype(np.uint64) + np.uint64(int(offset or 0))
            for j, dst in enumerate(d.strip() for d in dsts.split(",")):
                regs[dst] = (memory[address.astype(np.int64)].astype(np.uint32) if op.endswith(".u8")
                             else load_word(address + np.uint64(4 * j)))
            continue
        if op == "mov.b32" and rest.startswith("{"):
            low, high, src = re.match(r"\{\s*(\w+),\s*(\w+)\s*\},\s*(\S+)", rest).groups()
            regs[low], regs[high] = value(src) & np.uint32(0xFFFF), value(src) >> np.uint32(16)
            continue
        dst, *args = (a.strip() for a in rest.split(","))
        if op == "cvt.f32.f16":
            regs[dst] = value(args[0]).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
            continue
        a = [np.asarray(value(arg), dtype=np.uint32) for arg in args]
        if op == "shl.b32":
            regs[dst] = (a[0].astype(np.uint64) << np.uint64(a[1])).astype(np.uint32)
        elif op == "shr.b32":
            regs[dst] = a[0] >> a[1]
        elif op == "and.b32":
            regs[dst] = a[0] & a[1]
        elif op == "or.b32":
            regs[dst] = a[0] | a[1]
        elif op == "mov.b32":
            regs[dst] = a[0]
        elif op == "lop3.b32":  # bit i of the table: f(a, b, c) with (a, b, c) = the bits of i, a highest
            table, out = int(a[3]), np.zeros_like(a[0] | a[1] | a[2])
            for i in range(8):
                if table >> i & 1:
                    out |= (a[0] if i & 4 else ~a[0]) & (a[1] if i & 2 else ~a[1]) & (a[2] if i & 1 else ~a[2])
            regs[dst] = out
        else:
            raise NotImplementedError(op)
    return [regs[f"${i}"] for i in range(num_outputs)]


def test_decode_ptx_gives_every_code_times_2_pow_minus_14() -> None:
    rng = np.random.default_rng(0)
    words = np.concatenate([np.arange(256, dtype=np.uint32) * np.uint32(0x01010101),
                            rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)])
    decoded = np.stack(run_ptx(triton_gemv._DECODE_PTX.value, 8, [words]), 1)
    codes = np.stack([(words >> np.uint32(4 * i)) & np.uint32(0xF) for i in range(8)], 1)
    assert np.array_equal(decoded, (E2M1[codes] * np.float32(2.0**-14)).view(np.uint32))  # -0 and subnormals too


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_x8_ptx_reads_eight_activations_as_fp32(dtype: str) -> None:
    memory = np.random.default_rng(1).integers(0, 256, 1024, dtype=np.uint8)
    addresses = np.arange(0, 1024 - 32, 16, dtype=np.uint64)
    asm = triton_gemv._BF16X8_PTX if dtype == "bf16" else triton_gemv._F32X8_PTX
    got = np.stack(run_ptx(asm.value, 8, [addresses], memory), 1)
    if dtype == "bf16":
        want = memory.view(np.uint16)[(addresses // 2).astype(np.int64)[:, None] + np.arange(8)].astype(np.uint32) << 16
    else:
        want = memory.view(np.uint32)[(addresses // 4).astype(np.int64)[:, None] + np.arange(8)]
    assert np.array_equal(got, want)
