"""The shard-embedding cases that the Triton kernel must match the torch reference on, bit for bit (a copy),
shared by the GPU test and the CPU test under the Triton interpreter: ids below, inside and past the shard
(rank 1 of a TP group, the vocab's padding rows included), K3's hidden 7168 and a width that is not a multiple
of the block, bf16 and fp32, written into a row of a larger buffer (the attention-residual sources), no tokens."""

from __future__ import annotations

from typing import Callable

import torch

from k3serve.kernels.embedding import naive


def check_embedding_matches_reference(shard_embedding: Callable, device: str, tokens: int) -> None:
    rows, start = 40, 40  # rank 1 of vocab rows [40, 80)
    for dtype in (torch.bfloat16, torch.float32):
        for width in (7168, 1100):
            weight = torch.randn(rows, width, device=device).to(dtype)
            ids = torch.randint(0, 3 * rows, (tokens,), device=device)
            ids[: min(tokens, 4)] = torch.tensor([0, start, start + rows - 1, start + rows], device=device)[:tokens]
            ref = naive.shard_embedding(weight, ids, start, None)
            out = shard_embedding(weight, ids, start, None)
            assert out.dtype == dtype and torch.equal(out, ref), f"{dtype} width {width}"
            sources = torch.full((3, tokens, width), float("nan"), device=device, dtype=dtype)
            assert shard_embedding(weight, ids, start, sources[1]).data_ptr() == sources[1].data_ptr()
            assert torch.equal(sources[1], ref) and sources[[0, 2]].isnan().all(), f"{dtype} width {width}, out="
    empty = shard_embedding(weight, ids[:0], start, None)
    assert empty.shape == (0, 1100)
