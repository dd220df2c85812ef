"""Per-head products on the GPU run one cuBLAS batched GEMM over the strided views and give the fp32
reference at MLA's shapes (K3 at TP8: 8 heads, nope 128, latent 512, v 128): bf16 query and W_UK with no
widened copies, the fp32 latent output and W_UV read transposed."""

from __future__ import annotations

import pytest
import torch

from k3serve.kernels import head_matmul as module
from k3serve.kernels.head_matmul import head_matmul, naive

from _close import assert_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_cublas_matches_reference(rows: int) -> None:
    module.last_backend.clear()
    q = torch.randn(rows, 8, 192, device="cuda").bfloat16()  # [nope | rope] rows
    kv_b = (torch.randn(8, 256, 512, device="cuda") / 16).bfloat16()  # [H, nope + v, L]
    w_uk, w_uv = kv_b[:, :128], kv_b[:, 128:].float()
    q_latent = head_matmul(q[..., :128], w_uk)
    assert q_latent.dtype == torch.float32 and q_latent.is_contiguous()
    assert_close("q absorbed", naive.head_matmul(q[..., :128], w_uk), q_latent, 1e-4, 1e-5)
    o_latent = torch.randn(rows, 8, 512, device="cuda")
    o = head_matmul(o_latent, w_uv.transpose(1, 2))
    assert_close("o absorbed", naive.head_matmul(o_latent, w_uv.transpose(1, 2)), o, 1e-4, 1e-5)
    assert module.last_backend == {"head_matmul": "cublas"}
