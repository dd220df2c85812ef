"""One MLA layer stepped over sequences whose prefixes sit in a paged cache, as prefix-cache hits do: shared by
the CPU and GPU specifications of the prefill's grouping (test_mla_prefill_groups*.py)."""

from __future__ import annotations

import torch

from k3serve.model.batch import ForwardBatch
from k3serve.model.config import ModelConfig
from k3serve.model.layers.mla import MLAAttention
from k3serve.model.parallel import TensorParallel

Seq = tuple[str, int, int]  # name, cached prefix, new tokens


def random_mla_layer(config: ModelConfig, dtype: torch.dtype, device: str) -> MLAAttention:
    with torch.device(device):
        layer = MLAAttention(config, TensorParallel(0, 1), dtype)
    for param in layer.parameters():
        param.copy_(torch.randn(param.shape) * 0.2)
    layer.process_weights_after_loading()
    return layer


class CachedPrefixes:
    """Each sequence's blocks, its prefix rows written with random latents and every other row NaN (a stray
    read shows), and its new tokens' layer inputs."""

    def __init__(self, layer: MLAAttention, seqs: list[Seq], block_size: int, hidden_size: int,
                 dtype: torch.dtype, device: str) -> None:
        self.seqs, self.block_size, width = {s[0]: s for s in seqs}, block_size, layer.kv_lora_rank + layer.rope
        self.tables, self.inputs, first = {}, {}, 0
        for name, prefix, new in seqs:
            self.tables[name] = list(range(first, first + -(-(prefix + new) // block_size)))
            first += len(self.tables[name]) + 1  # a gap block between sequences, never written
            self.inputs[name] = torch.randn(new, hidden_size).to(device, dtype)
        self.kv_cache = torch.full((first, block_size, width), float("nan"), dtype=dtype, device=device)
        for name, prefix, _ in seqs:
            pos = torch.arange(prefix)
            rows = torch.tensor(self.tables[name])[pos // block_size]
            self.kv_cache[rows, pos % block_size] = torch.randn(prefix, width).to(device, dtype)

    def inputs_of(self, names: list[str]) -> tuple[torch.Tensor, ForwardBatch, torch.Tensor]:
        """(x, batch, a copy of the cache) of one step over `names`, packed in that order."""
        seqs = [self.seqs[name] for name in names]
        batch = ForwardBatch.build([[0] * new for _, _, new in seqs], [prefix for _, prefix, _ in seqs],
                                   [self.tables[name] for name in names], list(range(len(seqs))), self.block_size,
                                   device=self.kv_cache.device)
        return torch.cat([self.inputs[name] for name in names]), batch, self.kv_cache.clone()

    def step(self, layer: MLAAttention, names: list[str]) -> dict[str, torch.Tensor]:
        """The layer's output rows per sequence, from one forward over `names` packed in one batch."""
        out = layer(*self.inputs_of(names))
        return dict(zip(names, out.split([self.seqs[name][2] for name in names])))
