"""k3serve: disaggregated prefill/decode serving for Kimi-K3-architecture models.

The public face is small: `LLM`, `SamplingParams`, `AsyncEngine` and the `k3serve` CLI.
Everything else lives in the subpackages `k3serve.{model,kernels,engine,transfer,prefill,
decode,cluster}`.
"""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# In a source checkout the subpackages are the sibling folders `kernels/`, `model/`, ... (the
# repository layout of docs/STRUCTURE.md); installed, setup.py places them inside this package.
# Extending __path__ lets `python -m k3serve.model.score` work from the repo root as well.
_repo_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "model")) and _os.path.isfile(
    _os.path.join(_repo_root, "setup.py")
):
    __path__.append(_repo_root)  # type: ignore[name-defined]

_LAZY = {
    "LLM": "k3serve.engine.llm",
    "SamplingParams": "k3serve.engine.sampling_params",
    "AsyncEngine": "k3serve.engine.async_engine",
}

__all__ = ["LLM", "SamplingParams", "AsyncEngine", "__version__"]


def __getattr__(name: str):
    """Import the heavy public classes on first use, so `import k3serve` stays cheap."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'k3serve' has no attribute {name!r}")
