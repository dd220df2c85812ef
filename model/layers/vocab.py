"""The embedding and the lm_head, sharded by vocab rows over the tensor-parallel ranks (vLLM's
`VocabParallelEmbedding` / `ParallelLMHead`).

K3's two tables (vocab 163840 x hidden 7168, bf16) are 2.35 GB each. Replicated, every rank of a TP8
engine holds both and reads the whole lm_head every decode step; sharded, a rank holds and reads 1/8.
Rank r holds vocab rows [r*S, (r+1)*S), S = ceil(vocab / tp):

    embedding  each rank looks up the ids of its rows (the others give 0), `all_reduce` sums the ranks
    lm_head    each rank computes the logits of its rows; `gather` assembles [rows, vocab] fp32 on rank 0,
               the only rank that samples (`engine/tp_group.py`): one collective into one buffer, then
               one copy that widens and orders them

A vocab that tp does not divide is padded: the rows past `vocab` (on the last ranks) are zero (the
loader fills real rows only) and their logits are cut off in `gather`, so nothing ever samples them.
At TP 1 both are the plain ops (one lookup; one GEMM and its fp32 cast), with no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.kernels.embedding import shard_embedding
from k3serve.kernels.linear import linear
from k3serve.model.layers.common import Sharded
from k3serve.model.parallel import TensorParallel


@dataclass(frozen=True)
class VocabShard:
    """Which vocab rows one rank holds: [start, start + rows), of which the ids < vocab_size are real."""

    vocab_size: int
    rows: int  # rows every rank holds, padding included: ceil(vocab_size / tp)
    start: int

    @classmethod
    def of(cls, vocab_size: int, tp: TensorParallel) -> VocabShard:
        rows = -(-vocab_size // tp.world_size)
        return cls(vocab_size, rows, tp.rank * rows)


class VocabParallel(Sharded):
    """A [vocab, hidden] table of which this rank holds its `shard` of rows. The checkpoint's tensor is
    [vocab_size, hidden]; the loader copies the real rows and zeroes the padding (`model/weights.py`)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.shard = VocabShard.of(vocab_size, tp)
        self.weight = self.add_param("weight", (self.shard.rows, hidden_size), dtype, tp_dim=0)


class VocabParallelEmbedding(VocabParallel):
    """`model.embed_tokens`."""

    def forward(self, token_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] embeddings of `token_ids` [T], written into `out` when given; the same on every rank."""
        if self.tp.world_size == 1:  # the whole table: an id outside it is an error (not a zero row)
            return torch.index_select(self.weight, 0, token_ids, out=out)
        return self.tp.all_reduce(shard_embedding(self.weight, token_ids, self.shard.start, out))


class ParallelLMHead(VocabParallel):
    """`lm_head`: this rank's logits, then all ranks' gathered on rank 0."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, shard.rows] in the weights' dtype: the logits of this rank's vocab rows (padding rows give 0)."""
        return linear(hidden.to(self.weight.dtype), self.weight)

    def gather(self, local: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab_size] fp32 in vocab order on rank 0 (padding cut off); None on the other ranks. Every
        rank must call it, in the same order (a collective). The ranks send their logits in the weights' dtype
        (half the bytes of fp32 at bf16) into one [tp, rows, shard.rows] buffer on rank 0: one collective, no
        concatenation. They cannot land in [rows, vocab] order directly (NCCL receives a rank's part as one
        flat run; there it is a column block), so one copy on rank 0 orders them and widens them in the same
        pass: the same values as widening first. With padding and more than one row, the result is a view
        whose rows are tp * shard.rows apart."""
        if self.tp.world_size == 1:
            return local.float()
        shards = self.tp.gather(local)
        if shards is None:
            return None
        tp, rows, shard_rows = shards.shape
        logits = torch.empty(rows, tp, shard_rows, dtype=torch.float32, device=shards.device)
        logits.copy_(shards.transpose(0, 1))
        return logits.view(rows, tp * shard_rows)[:, : self.shard.vocab_size]
