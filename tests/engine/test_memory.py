"""The memory plan counts exactly the weight bytes a loaded engine holds: the loaded tensors and what is
derived from them at load time (fp32 router and MLA absorption weights in a bf16 model), each storage once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3serve.engine.memory import weight_bytes
from k3serve.model.config import ModelConfig
from k3serve.model.loader import load_model


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct storage a real model's modules reference."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for m in model.modules() for v in vars(m).values()
                for t in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(t, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planned_weight_bytes_equal_what_a_loaded_model_holds(tiny_checkpoint: Path, dtype: torch.dtype) -> None:
    config = ModelConfig.from_dir(tiny_checkpoint)
    assert weight_bytes(config, 1, dtype) == _held_bytes(load_model(tiny_checkpoint, dtype=dtype))


def test_bf16_plan_includes_the_fp32_copies_derived_at_load(tiny_checkpoint: Path) -> None:
    config = ModelConfig.from_dir(tiny_checkpoint)
    model = load_model(tiny_checkpoint, dtype=torch.bfloat16)
    loaded = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert weight_bytes(config, 1, torch.bfloat16) > loaded
    scores = model.model.layers[0].attn_res_scores  # derived too, kept as a tuple of tensors
    assert scores and weight_bytes(config, 1, torch.bfloat16) - loaded >= sum(t.nbytes for t in scores)
