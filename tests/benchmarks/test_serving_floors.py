"""benchmarks/_serving_floors.py's TP-collectives model is what the model issues: its list of collectives equals,
message for message, the all-reduces and gathers a forward of k3-tiny at TP 2 calls (rank 0, counted)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from k3serve.model.batch import ForwardBatch, ModelCache
from k3serve.model.config import ModelConfig
from k3serve.model.model import KimiForCausalLM
from k3serve.model.parallel import TensorParallel
from k3serve.model.presets import K3_TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _serving_floors import collectives_seconds, step_collectives  # noqa: E402


class CountingTP(TensorParallel):
    """Rank 0 of a TP group that records each collective's (kind, bytes) instead of running it."""

    calls: list[tuple[str, int]]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_reduce", x.numel() * x.element_size()))
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("gather", x.numel() * x.element_size()))
        return x.unsqueeze(0).expand(self.world_size, *x.shape)


def test_the_modelled_collectives_are_the_ones_a_forward_issues() -> None:
    config = ModelConfig.from_hf_dict(copy.deepcopy(K3_TINY))
    tp = CountingTP(0, 2)
    object.__setattr__(tp, "calls", [])
    model = KimiForCausalLM(config, tp, torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    for name, b in model.named_buffers():  # MXFP4 experts: codes of 0.5, scales of 1
        if b.dtype == torch.uint8:
            b.fill_(127 if name.endswith("scale") else 0x11)
    model.process_weights_after_loading()
    cache = ModelCache.allocate(config, 8, 4, 16, 2, torch.bfloat16, "cpu")
    tokens = list(range(1, 6))
    hidden = model(ForwardBatch.build([tokens], [0], [[0]], [0], 16, device="cpu"), cache)
    model.compute_logits(hidden[-1:])
    modelled = step_collectives(config, len(tokens), 1, vocab_rows=config.vocab_size // 2)
    assert [(c.kind, c.bytes) for c in modelled] == tp.calls


def test_a_collective_costs_its_latency_and_its_ring_bytes() -> None:
    config = ModelConfig.from_hf_dict(copy.deepcopy(K3_TINY))
    one = step_collectives(config, 1, 1)[:1]  # the embedding's all-reduce: 64 bf16
    assert collectives_seconds(one, 8, 1e9, 1e-5) == 1e-5 + 2 * 7 / 8 * 128 / 1e9
