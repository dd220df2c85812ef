"""Specification of the distribution: a regular (non-editable) install maps the repository's
top-level folders into the `k3serve` namespace and installs nothing else at the top level.

    repo: k3serve/  model/  kernels/  engine/ ...   ->   site-packages: k3serve/{model,kernels,engine,...}
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("cluster", "prefill", "decode", "transfer", "kernels", "model", "engine")
# Not part of the distribution; skipped when copying so the build never touches the working tree.
NOT_SHIPPED = (".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".venv", "tests", ".ci")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pip install a copy of the repository (pip builds in-tree) into a --target folder."""
    tmp_path = tmp_path_factory.mktemp("install")
    source, target = tmp_path / "source", tmp_path / "target"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_SHIPPED))
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=120,
    )
    assert pip.returncode == 0, f"pip install failed:\n{pip.stderr[-3000:]}"
    return target


def test_install_maps_top_level_folders_into_the_k3serve_namespace(target: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"  # neither the repo nor the install: nothing importable by cwd
    elsewhere.mkdir()
    probe = (
        "import k3serve, k3serve.model.config, k3serve.kernels.kda, importlib.util\n"
        "print(k3serve.__file__); print(k3serve.model.config.__file__); print(k3serve.kernels.kda.__file__)\n"
        "print(importlib.util.find_spec('model') is None and importlib.util.find_spec('kernels') is None)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"importing the installed package failed:\n{result.stderr[-3000:]}"
    *files, no_top_level = result.stdout.split()
    for file in files:
        assert Path(file).resolve().is_relative_to(target.resolve()), f"{file} was not imported from the install"
    assert no_top_level == "True", "a top-level `model` or `kernels` package is importable"


def test_install_puts_only_k3serve_at_the_top_level(target: Path) -> None:
    top = {p.name for p in target.iterdir()} - {"bin"}  # bin/: the `k3serve` console script
    assert {n for n in top if not n.endswith(".dist-info")} == {"k3serve"}
    assert {d for d in SUBPACKAGES if (target / "k3serve" / d / "__init__.py").is_file()} == set(SUBPACKAGES)
    for name in SUBPACKAGES:
        assert not (target / name).exists(), f"top-level package {name!r} installed"
    record = next(target.glob("k3serve-*.dist-info")).joinpath("RECORD").read_text().splitlines()
    paths = [line.split(",")[0] for line in record]
    stray = [p for p in paths if not p.startswith(("k3serve/", "k3serve-")) and not p.endswith("bin/k3serve")]
    assert not stray, f"files outside k3serve/: {stray[:5]}"
