"""One call from a checkpoint directory (or a preset name) to a ready model on this rank."""

from __future__ import annotations

from pathlib import Path

import torch

from k3serve.model.config import ModelConfig
from k3serve.model.model import KimiForCausalLM
from k3serve.model.parallel import SINGLE, TensorParallel
from k3serve.model.weights import load_weights


def load_model(
    model_dir: str | Path,
    tp: TensorParallel = SINGLE,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> KimiForCausalLM:
    """Build the model for rank `tp.rank` and load its shard of the weights in `model_dir`."""
    config = ModelConfig.from_dir(model_dir)
    with torch.device(device):
        model = KimiForCausalLM(config, tp, dtype)
    load_weights(model, model_dir)
    model.process_weights_after_loading()
    if torch.device(device).type == "cuda":  # return the blocks the stacked projections replaced at build time,
        torch.cuda.empty_cache()  # which the caching allocator would otherwise keep out of the KV pool's reach
    return model.eval()
