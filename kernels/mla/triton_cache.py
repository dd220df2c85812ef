"""Writing new tokens' latent rows into the paged MLA cache in Triton (vLLM's reshape_and_cache), sync-free.

One program = one token: slot -1 returns at once, any other slot s stores the row at block s // block_size,
offset s % block_size. The torch form needs a boolean mask to skip -1 rows, which costs a host sync (its
size is data-dependent); this kernel reads the slot on the device, so a decode step, and a captured CUDA
graph of one, can pad its batch with rows of slot -1.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .._backend import device_of, unit_stride_rows


@triton.jit
def _write_kernel(kv_cache, slot_mapping, latent, D, PAGE, stride_cb, stride_ct, stride_t,
                  BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    row = tl.load(latent + t * stride_t + offs, mask=ok)
    tl.store(kv_cache + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + offs, row, mask=ok)


def write_kv_cache(kv_cache: Tensor, slot_mapping: Tensor, latent: Tensor) -> None:
    """kv_cache [num_blocks, block_size, D] <- latent [T, D] (same dtype, any row stride) at slot_mapping [T]
    (-1 = skip)."""
    T, D = latent.shape
    if T == 0:
        return
    latent = unit_stride_rows(latent)  # rows of any stride are read where they are (a fused projection's columns)
    slot_mapping = slot_mapping.contiguous()
    BLOCK_D = min(triton.next_power_of_2(D), 1024)
    with device_of(latent):
        _write_kernel[(T, triton.cdiv(D, BLOCK_D))](
            kv_cache, slot_mapping, latent, D, kv_cache.shape[1], kv_cache.stride(0), kv_cache.stride(1),
            latent.stride(0), BLOCK_D=BLOCK_D,
        )
