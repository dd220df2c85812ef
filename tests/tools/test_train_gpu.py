"""The trainers on CUDA (benchmarks/train_gpu.sh trains there): one training step's loss and gradients equal the
CPU's, for the K3 target (QAT's MXFP4 rounding included) and for its EAGLE drafter (fp32, TF32 off)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3serve.model.config import ModelConfig
from k3serve.model.draft.config import DrafterConfig
from tools.train.draft import TargetAndDrafter, TrainableEagle, drafter_config
from tools.train.model import TrainableK3
from tools.train.recipe import DRAFT_RECIPES, RECIPES

pytestmark = pytest.mark.gpu


def _cpu_and_cuda(model: torch.nn.Module, loss_of) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """(loss, gradients) of `loss_of(model copy, device)` on the CPU and on CUDA, TF32 off (the short conv too)."""
    results = []
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for device in ("cpu", "cuda"):
            m = copy.deepcopy(model).to(device)
            loss = loss_of(m, device)
            loss.backward()
            results.append((loss.item(), {n: p.grad.cpu() for n, p in m.named_parameters() if p.grad is not None}))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return results


def _assert_same(results: list[tuple[float, dict[str, torch.Tensor]]]) -> None:
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = results
    assert abs(cpu_loss - gpu_loss) < 1e-4
    assert cpu_grads and cpu_grads.keys() == gpu_grads.keys()
    for name in cpu_grads:
        torch.testing.assert_close(gpu_grads[name], cpu_grads[name], rtol=1e-3, atol=1e-4, msg=name)


def test_a_training_step_on_cuda_equals_the_cpus() -> None:
    recipe = RECIPES["micro"]
    model = TrainableK3(ModelConfig.from_hf_dict(recipe.hf_config(0, 1)), recipe.kda_chunk)
    model.set_fake_quant(True)
    token_ids = torch.randint(0, recipe.vocab_size, (2, 41))

    def loss_of(m: TrainableK3, device: str) -> torch.Tensor:
        ids = token_ids.to(device)
        return F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    _assert_same(_cpu_and_cuda(model, loss_of))


def test_a_drafter_training_step_on_cuda_equals_the_cpus(tmp_path: Path) -> None:
    recipe, draft = RECIPES["micro"], DRAFT_RECIPES["micro"]
    target_hf = recipe.hf_config(0, 1)
    (tmp_path / "config.json").write_text(json.dumps(target_hf))
    target = TrainableK3(ModelConfig.from_hf_dict(target_hf), recipe.kda_chunk).requires_grad_(False)
    drafter = TrainableEagle(DrafterConfig.from_hf_dict(drafter_config(tmp_path, draft)).model)
    token_ids = torch.randint(0, recipe.vocab_size, (2, 24 + draft.unroll))

    def loss_of(m: TrainableEagle, device: str) -> torch.Tensor:
        return TargetAndDrafter(copy.deepcopy(target).to(device), m, draft).step(token_ids.to(device))[0]

    _assert_same(_cpu_and_cuda(drafter, loss_of))
