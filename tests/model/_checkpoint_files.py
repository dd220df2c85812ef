"""Reading a checkpoint's tensors as published, for the tests that compare loaded weights with them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def read_tensor(checkpoint: Path, name: str) -> torch.Tensor:
    """The whole tensor `name` of the sharded checkpoint in `checkpoint` (found through its index)."""
    shard = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(checkpoint / shard), framework="pt") as f:
        return f.get_tensor(name)
