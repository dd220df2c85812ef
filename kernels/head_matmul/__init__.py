"""Per-head matrix products with an fp32 result: MLA's absorbed decode multiplies each head's query by its
W_UK and its latent output by its W_UV (`model/layers/mla.py`).

    out[n, h] = x[n, h] @ w[h]        x [N, H, K], w [H, K, M] -> out [N, H, M] fp32

x and w share one floating dtype. 16-bit inputs are not widened first: their products are exact in fp32 and
summed in fp32, which is what widening both and multiplying in fp32 (the reference) computes, without the
widened copies. On CUDA that is one cuBLAS batched GEMM (`torch.bmm` with an fp32 out_dtype for 16-bit
inputs), reading x's head-strided view and w's transposed view as they are; elsewhere the fp32 einsum of
`naive.py`. `last_backend["head_matmul"]` records which."""

from __future__ import annotations

from torch import Tensor

from .._backend import gpu_kernels
from . import naive

last_backend: dict[str, str] = {}  # "head_matmul" -> "cublas" | "naive"

__all__ = ["head_matmul"]


def head_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x [N, H, K] @ w [H, K, M] per head -> fp32 [N, H, M], contiguous (x and w of any strides)."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise ValueError(f"x must be [N, H, K] and w [H, K, M], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if not x.is_floating_point() or x.dtype != w.dtype:
        raise ValueError(f"x and w must share one floating dtype, got {x.dtype} and {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"x and w must be on one device, got {x.device} and {w.device}")
    if gpu_kernels(x, w):
        from . import cublas

        last_backend["head_matmul"] = "cublas"
        return cublas.head_matmul(x, w)
    last_backend["head_matmul"] = "naive"
    return naive.head_matmul(x, w)
