"""Checkpoints shipped inside the package (`model/assets/`), named like presets but trained, not random.

`k3-code` is the embedded default: the K3 architecture trained on the CPython standard library by
`tools/train` (recipe `k3-code`; docs/design/trained_model.md). `k3-code-eagle` is its EAGLE drafter, trained
against its hidden states by `tools/train/draft.py`; `speculative_config.model` may name it. Both are read by the
same loaders as published checkpoints; nothing is written for them. `resolve_model_dir` is what a `model` argument
names: a directory, a shipped model or a preset's checkpoint (imports no torch: the ingress calls it too)."""

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


def resolve_model_dir(model: str, seed: int, cache_dir: str) -> Path:
    """A checkpoint directory as given, a shipped model's, or a preset's checkpoint, written once into `cache_dir`
    and reused. ValueError if `model` is none of them, or names a shipped model whose files are not there."""
    from k3serve.model.presets import PRESETS

    path = Path(model)
    if path.is_dir():
        return path
    if (packaged := packaged_model_dir(model)) is not None:
        return packaged
    if model in PACKAGED_MODELS:
        raise ValueError(f"the shipped model {model!r} has no config.json in {PACKAGED_MODELS[model]}: its files are "
                         "missing from this checkout or install (clone the repository whole, or pass --model DIR)")
    if model not in PRESETS:
        raise ValueError(f"model {model!r} is neither a checkpoint directory, a shipped model {sorted(PACKAGED_MODELS)}"
                         f" nor a preset {sorted(PRESETS)}")
    out = Path(cache_dir) / f"{model}-seed{seed}"
    if not (out / "config.json").is_file():
        from k3serve.model.checkpoint import make_checkpoint

        tmp = out.with_name(out.name + ".tmp")
        make_checkpoint(model, tmp, seed=seed)
        tmp.rename(out)  # atomic: a half-written checkpoint is never picked up
    return out


def _shipped(table: dict[str, Path], name: str) -> Path | None:
    path = table.get(name)
    return path if path is not None and (path / "config.json").is_file() else None
