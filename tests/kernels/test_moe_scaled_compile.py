"""What holds of the Blackwell MXFP4 experts (`kernels/moe/triton_scaled.py`) without a Blackwell GPU: both kernels
compile for sm_100 and sm_103 (B200, GB300) through ptxas to a cubin; their product is the block-scaled MMA
(`tcgen05.mma ... kind::mxf8f6f4.block_scale`: e4m3 activations, e2m1 weights, E8M0 scales), never an upcast to a
bf16 MMA; and the largest tile fits a Blackwell SM's 227 KiB of shared memory. The numerics are checked in
test_moe_scaled_triton_interpret.py; nothing here runs the cubin."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from k3serve.kernels.moe import triton_scaled  # noqa: E402

BLOCK_SCALED_MMA = "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale"
SM100_SHARED_BYTES = 227 * 1024
TYPES = {"x": "*bf16", "h": "*bf16", "out": "*fp32", "topk_weights": "*fp32", "beta": "fp32", "linear_beta": "fp32"}


def _blackwell_toolchain_missing() -> str | None:
    """Why this triton cannot compile for sm_100 here, or None: its NVIDIA backend and a ptxas >= 12.8."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as e:
        return f"triton has no NVIDIA backend ({e})"
    tool = get_ptxas(100)
    if tool is None:
        return "no ptxas for sm_100 (triton.knobs.nvidia.ptxas_blackwell)"
    version = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", tool.version).groups())
    return None if version >= (12, 8) else f"ptxas {tool.version} predates sm_100a (needs 12.8)"


pytestmark = pytest.mark.skipif(_blackwell_toolchain_missing() is not None,
                                reason=f"cannot compile for sm_100: {_blackwell_toolchain_missing()}")


def _compile(kernel, constants: dict, num_warps: int, arch: int):
    """The autotuned `kernel` at one config, for sm_`arch`: weights and scales as bytes, routing int32, pointers and
    strides 16-divisible."""
    fn = kernel.fn
    names = [n for n in fn.arg_names if n not in constants]
    signature = {n: TYPES.get(n, "*u8" if n[0] == "w" else "*i32" if n.endswith(("pairs", "starts", "counts",
                 "experts", "active")) else "i32") for n in names}
    signature.update({n: "constexpr" for n in constants})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(signature)
             if signature[n][0] == "*" or n.startswith("stride")}
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": 3})


CASES = [(triton_scaled.scaled_up_kernel, {"ACT": 1}, 16, 4, 100),  # the decode tile
         (triton_scaled.scaled_down_kernel, {}, 16, 4, 100),
         (triton_scaled.scaled_up_kernel, {"ACT": 0}, 64, 8, 103),  # the largest tiles: 114.5 KiB and 129 KiB
         (triton_scaled.scaled_down_kernel, {}, 128, 8, 103)]


@pytest.mark.parametrize("kernel, constants, block_t, num_warps, arch", CASES,
                         ids=["up-T16-sm100", "down-T16-sm100", "up-T64-sm103", "down-T128-sm103"])
def test_compiles_to_the_block_scaled_mma(kernel, constants: dict, block_t: int, num_warps: int, arch: int) -> None:
    compiled = _compile(kernel, {**constants, "BLOCK_T": block_t, "BLOCK_K": 128, "NATIVE": True}, num_warps, arch)
    ptx = compiled.asm["ptx"]
    assert f".target sm_{arch}a" in ptx
    assert BLOCK_SCALED_MMA in ptx
    assert "kind::f16" not in ptx and "mma.sync" not in ptx  # no upcast MMA beside it
    assert len(compiled.asm["cubin"]) > 0
    assert compiled.metadata.shared <= SM100_SHARED_BYTES


def test_the_compiled_tiles_are_each_kernels_autotune_configs() -> None:
    for kernel, _, block_t, num_warps, _ in CASES:
        assert (block_t, 128, num_warps) in {(c.kwargs["BLOCK_T"], c.kwargs["BLOCK_K"], c.num_warps)
                                              for c in kernel.configs}
    assert max(c.kwargs["BLOCK_T"] for c in triton_scaled.scaled_up_kernel.configs) == 64  # [256, 128] fp32 in TMEM
