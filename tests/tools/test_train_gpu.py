"""The trainable K3 on CUDA (benchmarks/train_gpu.sh trains there): one training step's loss and gradients equal
the CPU's, QAT's MXFP4 rounding included (fp32, TF32 off)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from k3serve.model.config import ModelConfig
from tools.train.model import TrainableK3
from tools.train.recipe import RECIPES

pytestmark = pytest.mark.gpu


def test_a_training_step_on_cuda_equals_the_cpus() -> None:
    recipe = RECIPES["micro"]
    model = TrainableK3(ModelConfig.from_hf_dict(recipe.hf_config(0, 1)), recipe.kda_chunk)
    model.set_fake_quant(True)
    token_ids = torch.randint(0, recipe.vocab_size, (2, 41))
    results = []
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # the short conv too
    try:
        for device in ("cpu", "cuda"):
            m = copy.deepcopy(model).to(device)
            ids = token_ids.to(device)
            loss = F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            results.append((loss.item(), {n: p.grad.cpu() for n, p in m.named_parameters() if p.grad is not None}))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = results
    assert abs(cpu_loss - gpu_loss) < 1e-4
    assert cpu_grads.keys() == gpu_grads.keys()
    for name in cpu_grads:
        torch.testing.assert_close(gpu_grads[name], cpu_grads[name], rtol=1e-3, atol=1e-4, msg=name)
