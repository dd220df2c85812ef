"""benchmarks/gluon_mxfp4_probe.py's claims that hold without a GPU: the host swizzle puts every byte where the
kernel's lanes read it, and the kernel compiles for sm_90 with its permute + reshape proven equal to the tensor-core
operand's layout (`assert_trivial`, else compilation fails) and no shared memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gluon_mxfp4_probe as probe  # noqa: E402


def test_swizzle_puts_a_lanes_bytes_of_a_group_side_by_side() -> None:
    N, K = 128, 96  # two row blocks, three MX groups
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
    stored = probe.swizzle(packed)
    groups = K // 32
    for rb, group, warp, lane_row, lane_col, colhi, rowbit in [(0, 0, 0, 0, 0, 0, 0), (1, 2, 3, 7, 3, 3, 1),
                                                               (0, 1, 2, 5, 1, 2, 0), (1, 0, 1, 3, 2, 1, 1)]:
        lane = lane_row * 4 + lane_col
        at = ((rb * groups + group) * 4 + warp) * 256 + lane * 8 + colhi * 2 + rowbit
        row = rb * 64 + warp * 16 + rowbit * 8 + lane_row
        col = group * 16 + colhi * 4 + lane_col
        assert stored[at] == packed[row, col]
    assert sorted(stored.tolist()) == sorted(packed.flatten().tolist())


def test_swizzle_refuses_shapes_the_kernel_cannot_tile() -> None:
    with pytest.raises(ValueError, match="N % 64"):
        probe.swizzle(torch.zeros(96, 16, dtype=torch.uint8))


def test_the_kernel_compiles_for_hopper_without_shared_memory() -> None:
    compiled = probe.compile_sm90(128)
    assert compiled.metadata.shared == 0
    assert "local_alloc" not in compiled.asm["ttgir"]
