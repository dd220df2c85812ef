"""What holds of the Gluon MMA experts (`kernels/moe/gluon_mma.py`) without a GPU: both kernels compile for sm_90
(an H100/H200, with the ptxas that ships with triton), and the loaded weight bytes and activations reach the MMA's
operand registers without shared memory: the k-slot order makes the permute + reshape a renaming of registers. A
change that made the compiler stage them through shared memory (a layout it cannot map) fails here."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from k3serve.kernels.moe import gluon_mma  # noqa: E402

POINTERS = {"x": "*bf16", "h": "*bf16", "out": "*fp32", "topk_weights": "*fp32", "beta": "fp32", "linear_beta": "fp32"}


def _compile(kernel, constants: dict):
    """`kernel` compiled for sm_90; weights and scales as bytes, routing as int32, pointers and strides 16-divisible."""
    names = [n for n in kernel.arg_names if n not in constants]
    signature = {n: POINTERS.get(n, "*i32" if n[0] == "w" and n.endswith("p") else "*u8" if n[0] == "w" else "*i32"
                 if n.endswith(("pairs", "starts", "counts", "experts", "active")) else "i32") for n in names}
    signature.update({n: "constexpr" for n in constants})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(signature) if signature[n][0] == "*"
             or n.startswith("stride")}
    return triton.compile(GluonASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": gluon_mma.NUM_WARPS})


@pytest.mark.parametrize("kernel, constants", [(gluon_mma.mma_up_kernel, {"ACT": 1, "G": 8}),
                                               (gluon_mma.mma_down_kernel, {"G": 8})], ids=["up", "down"])
def test_compiles_for_hopper_without_shared_memory(kernel, constants: dict) -> None:
    compiled = _compile(kernel, constants)
    assert compiled.metadata.shared == 0
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in compiled.asm["ptx"]


def test_a_k_step_unrolls_the_most_groups_that_divide_k() -> None:
    assert [gluon_mma.groups_a_step(g) for g in (112, 96, 4, 6, 3)] == [8, 8, 4, 2, 1]
