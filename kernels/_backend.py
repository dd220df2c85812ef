"""Which implementation runs an op: the GPU one when every tensor is on CUDA and its library imports,
else the torch reference (`naive.py`). GPU modules are imported only after that check, so CPU
installs never need triton or fla.

Each op package keeps `last_backend: dict[str, str]` (function name -> "naive" | "fla" | "triton"):
the GPU tests assert on it, so a silent fallback to the reference fails them."""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch
from torch import Tensor


@functools.cache
def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def on_cuda(*tensors: Tensor | None) -> bool:
    """True when every given tensor (None skipped) lives on a CUDA device."""
    return all(t is None or t.is_cuda for t in tensors)


def device_of(t: Tensor) -> contextlib.AbstractContextManager:
    """The CUDA device context of t (launches go to its device); a no-op for CPU tensors (Triton interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
