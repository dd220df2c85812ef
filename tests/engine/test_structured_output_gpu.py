"""Structured outputs on CUDA: the mask as xgrammar's CUDA kernel applies it, and the engine replaying its decode
CUDA graphs with constrained and unconstrained requests in the same batches.

- `TokenMask.apply` on CUDA gives exactly the reference (a token whose bit is 0 -> -inf, others untouched; rows
  not in the mask untouched), at K3's vocabulary (163840) and an awkward one, for some rows and for every row,
  on the engine's device even when it is not the current one;
- the engine (bf16, padded decode graphs) gives constrained outputs of their language, finish "stop", and every
  unconstrained greedy token is its row's raw argmax (rank 1): the mask reaches constrained rows only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3serve.engine.llm import LLM
from k3serve.engine.structured_output import TokenMask

from test_structured_output import run_mixed_batch

pytestmark = pytest.mark.gpu


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Plain torch on the host: row rows[j] of a copy of `logits` gets -inf where bit t of bitmask[j] is 0."""
    out = logits.cpu().clone()
    vocab = out.shape[1]
    for j, row in enumerate(rows):
        words = bitmask[j].to(torch.int64) & 0xFFFFFFFF
        bits = (words[:, None] >> torch.arange(32)) & 1
        out[row] = out[row].masked_fill(bits.flatten()[:vocab] == 0, float("-inf"))
    return out


@pytest.mark.parametrize("vocab", [163840, 1001])
@pytest.mark.parametrize("rows", [[1, 5, 6, 30], list(range(32))], ids=["some_rows", "every_row"])
def test_the_mask_on_cuda_is_exact(vocab: int, rows: list[int]) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(32, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31, (len(rows), -(-vocab // 32)), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32).pin_memory()
    device = torch.device("cuda", torch.cuda.device_count() - 1)  # the last GPU: not the current one where two
    on_device = logits.to(device)
    TokenMask(bitmask, rows).apply(on_device)
    assert torch.equal(on_device.cpu(), reference_mask(logits, bitmask, rows))


def test_engine_on_cuda_with_decode_graphs_masks_constrained_rows_only(k3_tiny_gpu_checkpoint: Path) -> None:
    llm = LLM(model=str(k3_tiny_gpu_checkpoint), device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=32, max_adaptive_batched_tokens=32, cache_memory_bytes=256 * 2**20, seed=0)
    graphs = llm.engine.runner.graphs
    assert graphs is not None, "bf16 on CUDA captures decode graphs"
    unconstrained = run_mixed_batch(llm.engine, with_constrained=True)  # checks the constrained outputs
    assert unconstrained["greedy"][3] == [1] * 14 and unconstrained["late"][3] == [1] * 6
    assert graphs.num_replays > 0
    assert llm.engine.structured_outputs.num_matchers == 0
