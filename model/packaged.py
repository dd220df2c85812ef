"""Checkpoints shipped inside the package (`model/assets/`), named like presets but trained, not random.

`k3-code` is the embedded default: the K3 architecture trained on the CPython standard library by
`tools/train` (recipe `k3-code`; docs/design/trained_model.md). It is read by the same loader as a published
checkpoint; nothing is written for it."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
PACKAGED_MODELS: dict[str, Path] = {"k3-code": ASSETS / "k3-code"}
DEFAULT_MODEL = "k3-code"


def packaged_model_dir(name: str) -> Path | None:
    """The shipped checkpoint directory called `name`, or None if no shipped model has that name."""
    path = PACKAGED_MODELS.get(name)
    return path if path is not None and (path / "config.json").is_file() else None
