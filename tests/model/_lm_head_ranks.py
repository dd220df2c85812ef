"""Both ranks' side of test_vocab_parallel.py's logits gather (rank 1 is a spawned process: importable by name).
Every rank builds the same seeded [VOCAB, HIDDEN] bf16 table and hidden rows, and keeps its own vocab rows."""

from __future__ import annotations

import torch

from k3serve.engine.tp_group import TPGroup
from k3serve.model.layers.vocab import ParallelLMHead
from k3serve.model.parallel import TensorParallel

VOCAB, HIDDEN, ROWS = 7, 16, 3  # 7 rows over 2 ranks: 4 each, the last one padding


@torch.no_grad()
def lm_head(tp: TensorParallel) -> tuple[ParallelLMHead, torch.Tensor]:
    """This rank's lm_head (its rows of the seeded table, padding zero) and the seeded [ROWS, HIDDEN] input."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen).to(torch.bfloat16)
    head = ParallelLMHead(VOCAB, HIDDEN, tp, torch.bfloat16)
    mine = table[head.shard.start : head.shard.start + head.shard.rows]
    head.weight.zero_()
    head.weight[: mine.shape[0]] = mine
    return head, hidden


def follower(init_method: str) -> None:
    """Rank 1: send its logits to rank 0 once."""
    group = TPGroup(1, 2, init_method, timeout_s=20.0)
    try:
        head, hidden = lm_head(group.tensor_parallel())
        assert head.gather(head.compute_logits(hidden)) is None  # only rank 0 receives
    finally:
        group.close()
