"""Which MXFP4 expert kernels the dispatch picks by the device's compute capability, read through
`_backend.cuda_capability` (replaced here by a fake device table): the block-scaled pair (`triton_scaled.py`) on
sm_100 and sm_103 (B200, GB300) at every batch size, today's upcast pairs by token count on Hopper and on sm_12x
(where Triton 3.6 lowers dot_scaled to an upcast bf16 MMA), and on CPU tensors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3serve.kernels.moe import triton_moe  # noqa: E402

CUDA = torch.device("cuda", 0)
TOKENS = (1, 8, 9, 192, 193, 4096)
UPCAST = ("gemv", "gemv", "mma", "mma", "dot", "dot")  # today's pairs for TOKENS (thresholds 8 and 192)


@pytest.fixture
def capability(monkeypatch: pytest.MonkeyPatch):
    """Set the fake CUDA device's (major, minor); kernel_pair reads it as the real device's."""
    def set_capability(major: int, minor: int) -> None:
        monkeypatch.setattr(triton_moe, "cuda_capability", lambda device: (major, minor))
    return set_capability


@pytest.mark.parametrize("major, minor", [(10, 0), (10, 3)], ids=["sm100", "sm103"])
def test_blackwell_datacenter_parts_run_the_block_scaled_pair_at_every_batch(capability, major: int,
                                                                             minor: int) -> None:
    capability(major, minor)
    assert [triton_moe.kernel_pair(t, CUDA) for t in TOKENS] == ["scaled"] * len(TOKENS)


@pytest.mark.parametrize("major, minor", [(9, 0), (8, 0), (12, 0)], ids=["sm90", "sm80", "sm120"])
def test_other_devices_keep_the_upcast_pairs(capability, major: int, minor: int) -> None:
    capability(major, minor)
    assert [triton_moe.kernel_pair(t, CUDA) for t in TOKENS] == list(UPCAST)


def test_cpu_tensors_never_ask_for_a_capability(capability) -> None:
    capability(10, 0)  # ignored: the interpreter runs on CPU tensors
    assert [triton_moe.kernel_pair(t, torch.device("cpu")) for t in TOKENS] == list(UPCAST)


def test_the_block_scaled_pair_tiles_only_whole_128_row_blocks() -> None:
    from k3serve.kernels.moe import triton_scaled
    from k3serve.kernels.mxfp4 import MXFP4Tensor

    def bank(*shape: int) -> MXFP4Tensor:
        *lead, out, inp = shape
        return MXFP4Tensor(torch.zeros(*lead, out, inp // 2, dtype=torch.uint8),
                           torch.zeros(*lead, out, inp // 32, dtype=torch.uint8))

    assert triton_scaled.supports(bank(2, 3072, 3584), bank(2, 3584, 3072))  # K3's rank shapes
    assert not triton_scaled.supports(bank(2, 192, 256), bank(2, 256, 192))  # I = 192: runs the upcast pick
