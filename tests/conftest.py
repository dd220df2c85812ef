"""Shared fixtures: a fixed RNG state for every test, and the two tiny checkpoints; under CI, a check that the
session left nothing in the temp root (tests write under pytest's `tmp_path`, which pyproject.toml has pytest
remove for passing tests).

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
    drafters                      {"eagle": DIR, "dspark": DIR}: random drafters for echo_checkpoint that propose the
                                  last token again (`make_drafter_checkpoint`'s echo_weight); "draft_model": a
                                  3-layer k3-tiny of another seed that repeats itself too
"""

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

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


@pytest.fixture(autouse=True)
def _fastapi_forgets_the_apps() -> Iterator[None]:
    """FastAPI (0.165) classifies each route's endpoint through module-level LRU caches of 4,096 entries, keyed by
    the endpoint itself; `build_app`'s endpoints close over their engine client, so every app a test builds kept
    its engine (model, pools, threads) alive to the session's end: 4.6 GB over tests/cluster/test_api.py alone.
    One app a process, as `k3serve serve` runs, is unaffected."""
    yield
    models = sys.modules.get("fastapi.dependencies.models")
    for value in vars(models).values() if models is not None else ():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("k3-tiny", tmp_path_factory.mktemp("k3-tiny"), seed=0)


@pytest.fixture(scope="session")
def echo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("k3-tiny", tmp_path_factory.mktemp("k3-tiny-echo"), seed=0, echo_weight=0.3)


@pytest.fixture(scope="session")
def drafters(tmp_path_factory: pytest.TempPathFactory, echo_checkpoint: Path) -> dict[str, Path]:
    from k3serve.model.draft.checkpoint import make_drafter_checkpoint

    out = {method: make_drafter_checkpoint(method, echo_checkpoint, tmp_path_factory.mktemp(f"{method}-drafter"),
                                           seed=1, echo_weight=3.0) for method in ("eagle", "dspark")}
    out["draft_model"] = make_checkpoint("k3-tiny", tmp_path_factory.mktemp("draft-model"), seed=1, num_layers=3,
                                         echo_weight=0.3)
    return out


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


_TEMP_ROOT = Path(tempfile.gettempdir())


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller of an xdist run (or a plain one) checks
        session.config.stash[_temp_entries] = set(os.listdir(_TEMP_ROOT))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI (`$CI`: a machine that runs this suite alone), entries the session added to the temp root beside
    pytest's own folder fail the run, named. Elsewhere other processes share the temp root, so it only checks CI."""
    if not os.environ.get("CI") or _temp_entries not in session.config.stash:
        return
    left = sorted(set(os.listdir(_TEMP_ROOT)) - session.config.stash[_temp_entries] - {f"pytest-of-{_user()}"})
    if left:
        session.config.get_terminal_writer().line(f"left in {_TEMP_ROOT} by the tests: {left}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _user() -> str:
    import getpass

    return getpass.getuser()


_temp_entries = pytest.StashKey[set]()
