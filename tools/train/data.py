"""Token streams of the corpus and the batches drawn from them.

A stream is every file of a split encoded in name order, each followed by the tokenizer's EOS: one int64
tensor. Training windows start at offsets drawn from a seeded generator; evaluation windows are the first
consecutive windows of a stream, so every evaluator (the trainer, `benchmarks/eval_model.py`) scores the same
tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3serve.model.tokenizer import Tokenizer
from tools.train.corpus import SourceFile


def token_stream(tokenizer: Tokenizer, files: list[SourceFile]) -> Tensor:
    """[N] int64: the files' tokens, each file closed by EOS."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to separate files with")
    ids: list[int] = []
    for f in files:
        ids += tokenizer.encode(f.text)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def train_batch(stream: Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """(inputs, targets) [batch_size, seq_len]: windows at random offsets, targets shifted by one."""
    if stream.numel() < seq_len + 2:
        raise ValueError(f"a stream of {stream.numel()} tokens is too short for windows of {seq_len + 1}")
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=gen)
    windows = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def eval_windows(stream: Tensor, seq_len: int, num_tokens: int) -> Tensor:
    """[n, seq_len + 1]: the first consecutive windows of `stream` scoring about `num_tokens` tokens (at least one)."""
    n = max(1, min(num_tokens // seq_len, (stream.numel() - 1) // seq_len))
    if stream.numel() < seq_len + 1:
        raise ValueError(f"a stream of {stream.numel()} tokens is too short for one window of {seq_len + 1}")
    return torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
