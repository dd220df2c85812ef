"""Checkpoints shipped inside the package (`model/assets/`), named like presets but trained, not random.

`k3-code` is the embedded default: the K3 architecture trained on the CPython standard library by
`tools/train` (recipe `k3-code`; docs/design/trained_model.md). `k3-code-eagle` is its EAGLE drafter, trained
against its hidden states by `tools/train/draft.py`; `speculative_config.model` may name it. Both are read by the
same loaders as published checkpoints; nothing is written for them."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
PACKAGED_MODELS: dict[str, Path] = {"k3-code": ASSETS / "k3-code"}
PACKAGED_DRAFTERS: dict[str, Path] = {"k3-code-eagle": ASSETS / "k3-code-eagle"}
DEFAULT_MODEL = "k3-code"


def packaged_model_dir(name: str) -> Path | None:
    """The shipped checkpoint directory called `name`, or None if no shipped model has that name."""
    return _shipped(PACKAGED_MODELS, name)


def packaged_drafter_dir(name: str) -> Path | None:
    """The shipped drafter checkpoint directory called `name`, or None if no shipped drafter has that name."""
    return _shipped(PACKAGED_DRAFTERS, name)


def _shipped(table: dict[str, Path], name: str) -> Path | None:
    path = table.get(name)
    return path if path is not None and (path / "config.json").is_file() else None
