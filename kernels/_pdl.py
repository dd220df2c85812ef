"""Programmatic dependent launch (PDL, sm_90+) for our Triton kernels.

A decode step is ~300 short kernels in a row, and without PDL each one's programs start only after the
kernel before has drained: the launch, the ramp-up and the first memory latency of every kernel add up.
Launched with PDL, a kernel's programs start while the kernel before still runs, do what needs nothing
from it (the skinny GEMM prefetches its first weight blocks into L2), and then `wait_for_previous` until
the kernel before has finished and its writes are visible. Right after that wait they let the kernel
after them launch, so at most one kernel runs ahead of the one it waits for.

Every kernel launched with `**launch_options(t)` takes a `PDL: tl.constexpr` and must call
`wait_for_previous(PDL)` before its first read of anything an earlier kernel writes and before its first
write (an earlier kernel may still read what it overwrites); what comes before the wait reads weights only.
Waiting is transitive: a kernel that waited knows that its predecessor, which waited too, saw its own
predecessor finish. Kernels launched without PDL (torch, cuBLAS) wait for the whole previous kernel as usual.

Off in the Triton interpreter, below sm_90, and with K3SERVE_PDL=0 or inside `pdl_disabled()` (the
benchmarks' anchor): then the kernels take PDL=False and launch as plain stream-ordered kernels."""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_enabled = os.environ.get("K3SERVE_PDL", "1") not in ("", "0")


@contextlib.contextmanager
def pdl_disabled(disabled: bool = True):
    """Within the block, kernels launch without PDL (a CUDA graph captured inside keeps plain launches)."""
    global _enabled
    saved, _enabled = _enabled, not disabled
    try:
        yield
    finally:
        _enabled = saved


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def launch_options(t: Tensor) -> dict[str, bool]:
    """The PDL constexpr and launch option for a kernel launched on t's device."""
    on = _enabled and t.is_cuda and not triton.knobs.runtime.interpret and _device_supports(
        t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait until the kernel before has finished (its writes visible), then let the kernel after launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
