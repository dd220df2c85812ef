"""Which implementation runs an op: the GPU one when every tensor is on CUDA and its library imports,
else the torch reference (`naive.py`). GPU modules are imported only after that check, so CPU
installs never need triton or fla.

Each op package keeps `last_backend: dict[str, str]` (function name -> "naive" | "fla" | "triton"):
the GPU tests assert on it, so a silent fallback to the reference fails them.

`reference_kernels()` (or K3SERVE_REFERENCE_KERNELS=1 in the environment) forces the reference on
CUDA tensors too: the anchor of the engine benchmark and the oracle of the GPU engine tests.
`reference_kernels_in_thread()` forces it for the calling thread alone: an engine built with
`kernels="reference"` runs its steps under it, beside engines of the same process that run ours."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading

import torch
from torch import Tensor


AUTOTUNE_FLUSH_BYTES = 256 * 2**20
"""Triton's autotuner zeroes a buffer of this size before timing each candidate, to flush L2 (its CUDA driver's
`get_empty_cache_for_benchmark`, allocated through torch): a kernel that autotunes (fla's chunk_kda, the MoE
experts) takes it mid-forward the first time it meets a new key, with that layer's activations live."""


@functools.cache
def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def on_cuda(*tensors: Tensor | None) -> bool:
    """True when every given tensor (None skipped) lives on a CUDA device."""
    return all(t is None or t.is_cuda for t in tensors)


_force_reference = os.environ.get("K3SERVE_REFERENCE_KERNELS", "") not in ("", "0")
_this_thread = threading.local()  # .force: the reference forced for this thread (reference_kernels_in_thread)


@contextlib.contextmanager
def reference_kernels(enabled: bool = True):
    """Within the block, every op runs its torch reference (`naive.py`), also on CUDA tensors."""
    global _force_reference
    saved, _force_reference = _force_reference, enabled
    try:
        yield
    finally:
        _force_reference = saved


@contextlib.contextmanager
def reference_kernels_in_thread(enabled: bool = True):
    """Within the block, the calling thread's ops run their torch reference (others' are untouched)."""
    saved = getattr(_this_thread, "force", False)
    _this_thread.force = enabled
    try:
        yield
    finally:
        _this_thread.force = saved


def reference_forced() -> bool:
    """Whether `reference_kernels()` (or the environment, or `reference_kernels_in_thread()` in this thread)
    forces the torch reference right now: the engine then runs eagerly, since a CUDA graph captured earlier
    would replay the GPU kernels regardless."""
    return _force_reference or getattr(_this_thread, "force", False)


def gpu_kernels(*tensors: Tensor | None) -> bool:
    """Whether an op may dispatch to its GPU implementation: every tensor on CUDA, and the reference
    is not forced."""
    return not reference_forced() and on_cuda(*tensors)


def unit_stride_rows(t: Tensor) -> Tensor:
    """t [..., N] as [R, N] rows with a unit inner stride, as the row-wise kernels read them (a copy only when
    it cannot be a view)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def to_device_async(values: list[int] | Tensor, device: torch.device) -> Tensor:
    """Host indices (an int list, as int64, or a tensor) on `device` without the host waiting for the GPU: to a GPU
    through a pinned buffer, non_blocking (a copy from pageable memory waits for the stream's queue to drain, which
    stalls the launches behind it). A list is written straight into the pinned buffer: torch.tensor(list) then
    pin_memory() builds it twice, and torch.tensor alone costs several times the numpy write (docs/BENCHMARKS.md)."""
    if device.type != "cuda" or (isinstance(values, Tensor) and values.device.type != "cpu"):
        return values.to(device) if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.int64, device=device)
    if isinstance(values, Tensor):
        host = values.pin_memory()
    else:
        host = torch.empty(len(values), dtype=torch.int64, pin_memory=True)
        host.numpy()[:] = values
    return host.to(device, non_blocking=True)


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def cuda_properties(device: torch.device):
    """A CUDA device's properties (SM count, shared memory per block), looked up once per device: the kernels'
    grids and tile rules read them on every launch."""
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (major, minor), e.g. (9, 0) for an H200, (10, 3) for a GB300: the MoE
    experts pick their kernels by it."""
    props = cuda_properties(device)
    return props.major, props.minor


def device_of(t: Tensor) -> contextlib.AbstractContextManager:
    """The CUDA device context of t (launches go to its device); a no-op for CPU tensors (Triton interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
