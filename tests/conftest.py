"""Shared fixtures: a fixed RNG state for every test, and the two tiny checkpoints.

Every test starts from the same RNG state, so a failure reproduces when run alone. The tiny
checkpoints are written once per session through the real checkpoint writer (sharded
safetensors, published tensor names), so every model test also runs the real loading path:

    tiny_checkpoint               k3-tiny: every K3 feature (VL wrapper, MXFP4 latent MoE, ...)
    kimi_linear_tiny_checkpoint   Kimi-Linear-style (flat config, bf16 plain MoE, ...)
    k3_tiny_gpu_checkpoint        K3_TINY_GPU: k3-tiny at K3's head sizes, for the GPU tests (written on
                                  the CPU, so it needs no device itself)
    echo_checkpoint               k3-tiny with 0.3 x the embedding added to its lm_head (`make_checkpoint`'s
                                  echo_weight): it repeats itself for a while, so speculative decoding's prompt
                                  lookup has drafts to accept (and to reject where a run changes)
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from k3serve.model.checkpoint import make_checkpoint
from k3serve.model.presets import K3_TINY_GPU
from tiny_presets import kimi_linear_tiny

# The tests run tiny tensors: one intra-op thread is as fast, and it keeps OpenMP workers from
# spinning against other processes on a busy host (that made the model tests 30x slower).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("k3-tiny", tmp_path_factory.mktemp("k3-tiny"), seed=0)


@pytest.fixture(scope="session")
def echo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("k3-tiny", tmp_path_factory.mktemp("k3-tiny-echo"), seed=0, echo_weight=0.3)


@pytest.fixture(scope="session")
def kimi_linear_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(kimi_linear_tiny(), tmp_path_factory.mktemp("kimi-linear-tiny"), seed=0)


@pytest.fixture(scope="session")
def k3_tiny_gpu_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(K3_TINY_GPU, tmp_path_factory.mktemp("k3-tiny-gpu"), seed=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need a CUDA device: skipped (not failed) where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_SERVING_DIRS = ("cluster", "serving")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`pytest -m gpu` on the GPU machine, which has no ASGI server: the serving folders (CPU only, no
    gpu tests) are not collected there instead of failing to import. Everywhere else a missing
    uvicorn stays an import error, so CI cannot skip the serving tests silently."""
    if config.option.markexpr != "gpu" or importlib.util.find_spec("uvicorn") is not None:
        return None
    if collection_path.is_dir() and collection_path.name in _SERVING_DIRS and collection_path.parent.name == "tests":
        return True
    return None  # let pytest's own rules decide everything else
